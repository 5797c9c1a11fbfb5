"""Issue 13 benchmarks: resident layers, rank-local from the page cache, auto mode, components.

Three parts, each in its own processes (clean device peaks), each written as soon as it
ends to ``OUT_DIR/<part>.json`` with command, machine, date and side-by-side ratios:

- ``resident``: one 4,096-token forward vs the number of resident blocks (0, 25, 50,
  100%), next to the model max(compute, (L-K)/L x bytes / H2D), plus one run under a
  device memory budget (the blocks it kept, its peak against the budget).
- ``ranklocal``: DP1 and DP2, AllGather vs rank-local packing vs rank-local DMA from the
  registered page cache: GB/s per rank, PSS sum, pinned and registered bytes; and what
  ``--dlo-mode auto``'s probe picks at each workload against the measured faster mode.
- ``pipeline``: the whole pipeline (text encoder, transformer, VAE) on one GPU, today's
  layout against every component offloaded: device peak and time per request.

    python loadtest/bench_placement.py --out-dir loadtest/results/placement      # H200
    python loadtest/bench_placement.py --device cpu --preset tiny --layers 4 --tokens 64 \\
        --sizes 32x32x5 --out-dir /tmp/smoke                                      # smoke
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from offload_strategies import _keep_fp32, _meta_transformer
from ranks import run_ranks
from reporting import Timer, h2d_probe, header, host_memory, inputs

from service.config import EngineConfig, OffloadConfig, OffloadMode
from service.config.offload import parse_probe_size
from service.offload import Placement, enable_layerwise_offload
from service.offload.auto import choose_mode, probe


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.float().cpu().numpy().tobytes()).hexdigest()


def _dev(kind: str, rank: int = 0) -> torch.device:
    if kind == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _forwards(module: torch.nn.Module, x: dict, dev: torch.device, reps: int, warmup: int = 1
              ) -> tuple[list[float], str]:
    times, digest = [], ""
    with torch.no_grad():
        for i in range(warmup + reps):
            with Timer(dev) as t:
                out = module(**x, return_dict=False)[0]
            if i == 0:
                digest = _sha(out)
            if i >= warmup:
                times.append(t.ms)
            del out
    return times, digest


# -- part 1: resident layers ------------------------------------------------------------


def _resident_worker(rank: int, world: int, model: str, kind: str, tokens: int, reps: int) -> dict:
    dev = _dev(kind)
    folder = Path(model) / "transformer"
    text_dim = json.loads((folder / "config.json").read_text())["text_dim"]
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    x = inputs(tokens, text_dim, dev, dtype)
    runs: dict[str, Any] = {}

    def one(name: str, placement: Placement) -> dict:
        module = _meta_transformer(folder)
        h = enable_layerwise_offload(module, folder, device=dev, block_attrs=["blocks"],
                                     keep_fp32=_keep_fp32(), placement=placement)
        if kind == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        st0 = h.stats()
        times, digest = _forwards(module, x, dev, reps)
        st = h.stats()
        fwd = st.forwards - st0.forwards
        r = {"resident_blocks": st.resident_blocks, "median_ms": statistics.median(times), "times_ms": times,
             "sha256": digest, "h2d_bytes_per_forward": (st.h2d_bytes - st0.h2d_bytes) / fwd,
             "stall_ms_per_forward": (st.stall_s - st0.stall_s) / fwd * 1000,
             "device_peak_bytes": st.device_peak_bytes, "device_slot_bytes": st.device_slot_bytes,
             "device_resident_bytes": st.device_resident_bytes, "budget_bytes": st.device_budget_bytes,
             "block_bytes": [lay.total_bytes for lay in h.layouts]}
        h.close()
        del module
        if kind == "cuda":
            torch.cuda.empty_cache()
        print(f"resident {name}: {r['median_ms']:.1f} ms, K={r['resident_blocks']}", flush=True)
        return r

    layers = int(json.loads((folder / "config.json").read_text())["num_layers"])
    for frac in (0.0, 0.25, 0.5, 1.0):
        k = round(frac * layers)
        runs[f"{int(frac * 100)}%"] = one(f"{int(frac * 100)}%", Placement(resident_blocks=k))
    # A budget that should hold half the blocks: K=0's peak (slots, non-block, activations)
    # plus half the block bytes; what the runtime keeps, and its peak against the budget.
    base = runs["0%"]
    activation = base["device_peak_bytes"] - base["device_slot_bytes"] - base["device_resident_bytes"]
    budget = base["device_peak_bytes"] + sum(base["block_bytes"]) // 2
    runs["budget"] = one("budget", Placement(device_memory_budget=budget,
                                             activation_bytes=max(activation, 0)))
    runs["budget"]["activation_bytes"] = activation
    return {"runs": runs, "h2d_gb_per_s": h2d_probe() if kind == "cuda" else None, "layers": layers}


def part_resident(args: argparse.Namespace) -> dict:
    res = run_ranks(_resident_worker, 1, args.model, args.device, args.tokens[0], args.reps,
                    timeout=args.timeout, backend="gloo")[0]
    runs, layers = res["runs"], res["layers"]
    compute = runs["100%"]["median_ms"]
    total = sum(runs["0%"]["block_bytes"])
    h2d = res["h2d_gb_per_s"]
    rows = []
    for name, r in runs.items():
        k = r["resident_blocks"]
        model_ms = max(compute, (layers - k) / layers * total / (h2d * 1e9) * 1000) if h2d else None
        rows.append({"run": name, "resident_blocks": k, "median_ms": r["median_ms"],
                     "model_ms": model_ms, "ratio_to_model": r["median_ms"] / model_ms if model_ms else None,
                     "ratio_to_all_resident": r["median_ms"] / compute,
                     "h2d_gb_per_forward": r["h2d_bytes_per_forward"] / 1e9,
                     "device_peak_gb": r["device_peak_bytes"] / 1e9,
                     "budget_gb": r["budget_bytes"] / 1e9 if r["budget_bytes"] else None,
                     "within_budget": (r["device_peak_bytes"] <= r["budget_bytes"]) if r["budget_bytes"]
                     else None,
                     "bitwise_equal_0": r["sha256"] == runs["0%"]["sha256"]})
    return {"tokens": args.tokens[0], "layers": layers, "pinned_h2d_gb_per_s": h2d, "rows": rows, "raw": runs}


# -- part 2: rank-local sources and auto -------------------------------------------------


def _ranklocal_worker(rank: int, world: int, model: str, kind: str, mode: str, tokens: list[int],
                      reps: int) -> dict:
    dev = _dev(kind, rank)
    folder = Path(model) / "transformer"
    text_dim = json.loads((folder / "config.json").read_text())["text_dim"]
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    group = dist.group.WORLD if world > 1 else None
    module = _meta_transformer(folder)
    t0 = time.perf_counter()
    h = enable_layerwise_offload(module, folder, device=dev, group=group,
                                 mode="allgather" if mode == "allgather" else "rank-local",
                                 block_attrs=["blocks"], keep_fp32=_keep_fp32(),
                                 placement=Placement(pagecache=None if mode == "pagecache" else False))
    out: dict[str, Any] = {"load_s": time.perf_counter() - t0, "workloads": {}}
    for n in tokens:
        x = inputs(n, text_dim, dev, dtype)
        w: dict[str, Any] = {}
        if mode == "pagecache":  # the auto probe, from this handle (its forwards warm up too)
            with torch.no_grad():
                c = choose_mode(probe(h, lambda x=x: module(**x, return_dict=False), group))
            w["auto"] = {"mode": c.mode, "reason": c.reason, "allgather_ms": c.allgather_s * 1e3,
                         "ranklocal_ms": c.ranklocal_s * 1e3}
        if group is not None:
            dist.barrier()
        st0 = h.stats()
        # the probe's forwards were the warm-up of a page-cache run
        times, digest = _forwards(module, x, dev, reps if n < 70000 else 1, warmup=0 if "auto" in w else 1)
        st = h.stats()
        fwd = st.forwards - st0.forwards
        med = statistics.median(times)
        w.update(median_ms=med, sha256=digest, stall_ms_per_forward=(st.stall_s - st0.stall_s) / fwd * 1e3,
                 h2d_gb_per_s=(st.h2d_bytes - st0.h2d_bytes) / fwd / (med / 1000) / 1e9)
        out["workloads"][str(n)] = w
    if group is not None:
        dist.barrier()  # every rank still maps the files while PSS is read (shared pages split)
    st = h.stats()
    pss = host_memory()["pss_bytes"]
    if group is not None:
        dist.barrier()
    out.update(source=st.rank_local_source, source_reason=st.source_reason, pinned_bytes=st.host_pinned_bytes,
               registered_bytes=st.host_registered_bytes, pss_bytes=pss,
               checkpoint_bytes=h.ckpt.nbytes, device_peak_bytes=st.device_peak_bytes)
    h.close()
    return out


def part_ranklocal(args: argparse.Namespace) -> dict:
    backend = "nccl" if args.device == "cuda" else "gloo"
    runs: dict[str, Any] = {}
    for world in (1, 2):
        for mode in ("allgather", "pack", "pagecache"):
            name = f"dp{world}-{mode}"
            t0 = time.perf_counter()
            try:
                runs[name] = {"world": world, "mode": mode, "ranks": run_ranks(
                    _ranklocal_worker, world, args.model, args.device, mode, args.tokens, args.reps,
                    timeout=args.timeout, backend=backend)}
            except RuntimeError as e:
                runs[name] = {"world": world, "mode": mode, "error": str(e)[-2000:]}
            print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    ref = runs.get("dp1-allgather", {}).get("ranks", [{}])[0].get("workloads", {})
    for name, run in runs.items():
        if "error" in run:
            continue
        r0 = run["ranks"][0]
        for n in args.tokens:
            ws = [r["workloads"][str(n)] for r in run["ranks"]]
            rows.append({"run": name, "tokens": n, "ms_per_forward": max(w["median_ms"] for w in ws),
                         "h2d_gb_per_s_per_rank": statistics.mean(w["h2d_gb_per_s"] for w in ws),
                         "source": r0["source"], "pinned_gb_per_rank": r0["pinned_bytes"] / 1e9,
                         "registered_gb_per_rank": r0["registered_bytes"] / 1e9,
                         "pss_sum_gb": sum(r["pss_bytes"] for r in run["ranks"]) / 1e9,
                         "checkpoint_gb": r0["checkpoint_bytes"] / 1e9,
                         "bitwise_equal_dp1_allgather": all(  # every rank ran the same input
                             w["sha256"] == ref.get(str(n), {}).get("sha256") for w in ws),
                         "auto": ws[0].get("auto")})
    picks = []
    for world in (1, 2):
        for n in args.tokens:
            mine = {r["run"]: r for r in rows if r["tokens"] == n and r["run"].startswith(f"dp{world}-")}
            t = {m: mine[f"dp{world}-{m}"]["ms_per_forward"] if f"dp{world}-{m}" in mine else None
                 for m in ("allgather", "pack", "pagecache")}
            auto = mine.get(f"dp{world}-pagecache", {}).get("auto")
            if auto is None or t["allgather"] is None or t["pagecache"] is None:
                continue
            rl = t["pagecache"]
            faster = "allgather" if t["allgather"] < rl else "rank-local"
            chosen = t["allgather"] if auto["mode"] == "allgather" else rl
            picks.append({"world": world, "tokens": n, "allgather_ms": t["allgather"], "ranklocal_ms": rl,
                          "faster": faster, "auto": auto["mode"], "auto_reason": auto["reason"],
                          "auto_over_best": chosen / min(t["allgather"], rl)})
    return {"tokens": args.tokens, "pinned_h2d_gb_per_s": h2d_probe() if args.device == "cuda" else None,
            "rows": rows, "auto_picks": picks, "runs": runs}


# -- part 3: the whole pipeline ----------------------------------------------------------


def _pipeline_worker(rank: int, world: int, model: str, kind: str, components: list[str],
                     sizes: list[list[int]]) -> dict:
    from service.models.pipeline import PipelineRunner
    from service.models.request import GenerationRequest

    dev = _dev(kind)
    t0 = time.perf_counter()
    settings = EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER, components=tuple(components)))
    runner = PipelineRunner.load(model, dev, config=settings)
    out: dict[str, Any] = {"load_s": time.perf_counter() - t0, "requests": {}}
    warm = GenerationRequest("warm-up", seed=1, height=256, width=256, num_frames=5, num_inference_steps=1)
    runner.frames(warm)  # kernels, allocator and page cache warm before the measured requests
    for h, w, f in sizes:
        req = GenerationRequest("a red fox running through snow", seed=5, height=h, width=w, num_frames=f,
                                num_inference_steps=1, guidance_scale=5.0)
        if kind == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        t = time.perf_counter()
        frames = runner.frames(req)
        seconds = time.perf_counter() - t
        out["requests"][f"{w}x{h}x{f}"] = {
            "seconds": seconds, "frames_sha256": hashlib.sha256(frames.tobytes()).hexdigest(),
            "device_peak_bytes": torch.cuda.max_memory_allocated(dev) if kind == "cuda" else None,
            "tokens": ((f - 1) // 4 + 1) * (h // 16) * (w // 16)}
        print(f"pipeline {components}: {w}x{h}x{f} {seconds:.1f} s", flush=True)
    st = runner.offload_stats()
    out["largest_block_bytes"] = st["largest_block_bytes"] if st else None
    out["components"] = runner.adapter.component_stats()
    runner.close()
    return out


def part_pipeline(args: argparse.Namespace) -> dict:
    layouts = {"today": ["dit"], "all-offloaded": ["dit", "text_encoder", "vae"]}
    res = {name: run_ranks(_pipeline_worker, 1, args.pipeline_model or args.model, args.device, comps,
                           args.sizes, timeout=args.timeout)[0] for name, comps in layouts.items()}
    rows = []
    for size, r in res["all-offloaded"]["requests"].items():
        base = res["today"]["requests"][size]
        rows.append({"size": size, "tokens": r["tokens"],
                     "today_peak_gb": (base["device_peak_bytes"] or 0) / 1e9,
                     "offloaded_peak_gb": (r["device_peak_bytes"] or 0) / 1e9,
                     "today_s": base["seconds"], "offloaded_s": r["seconds"],
                     "time_ratio": r["seconds"] / base["seconds"],
                     "bitwise_equal": r["frames_sha256"] == base["frames_sha256"]})
    return {"largest_block_gb": res["today"]["largest_block_bytes"] / 1e9, "rows": rows, "runs": res}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default="wan14b-shape")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--model", help="a Wan pipeline folder; default: write the preset to a temp dir")
    p.add_argument("--pipeline-model", help="for the pipeline part (default: write wan14b-umt5xxl on CUDA)")
    p.add_argument("--tokens", type=lambda s: [int(t) for t in s.split(",")], default=[4096, 32760, 75600])
    p.add_argument("--sizes", type=lambda s: [parse_probe_size(x) for x in s.split(",")],
                   default=None, help="WIDTHxHEIGHTxFRAMES,... for the pipeline part")
    p.add_argument("--parts", default="resident,ranklocal,pipeline")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out-dir", required=True)
    args = p.parse_args(argv)
    args.sizes = args.sizes or [[480, 832, 81], [720, 1280, 81]]
    from service.models.demo import write_demo_model

    init = "cuda" if args.device == "cuda" else "cpu"
    tmp = Path(tempfile.gettempdir())
    if args.model is None:
        args.model = str(tmp / f"dloserve-bench-{args.preset}-L{args.layers}")
        if not (Path(args.model) / "model_index.json").is_file():
            t0 = time.perf_counter()
            write_demo_model(args.model, args.preset, args.layers, init_device=init)
            print(f"wrote {args.preset} x {args.layers} in {time.perf_counter() - t0:.0f} s", flush=True)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = {"resident": part_resident, "ranklocal": part_ranklocal, "pipeline": part_pipeline}
    for name in args.parts.split(","):
        if name == "pipeline" and args.pipeline_model is None and args.preset == "wan14b-umt5xxl":
            args.pipeline_model = args.model  # one model for all parts: its transformer is wan14b-shape's
        if name == "pipeline" and args.pipeline_model is None and args.device == "cuda":
            args.pipeline_model = str(tmp / f"dloserve-bench-wan14b-umt5xxl-L{args.layers}")
            if not (Path(args.pipeline_model) / "model_index.json").is_file():
                t0 = time.perf_counter()
                write_demo_model(args.pipeline_model, "wan14b-umt5xxl", args.layers, init_device=init)
                print(f"wrote wan14b-umt5xxl x {args.layers} in {time.perf_counter() - t0:.0f} s", flush=True)
        t0 = time.perf_counter()
        try:
            result = parts[name](args)
        except Exception as e:  # noqa: BLE001 - the other parts still run and are written
            result = {"error": repr(e)[-3000:]}
        report = {**header(args.device), "part": name, "seconds": time.perf_counter() - t0,
                  "model": {"preset": args.preset, "layers": args.layers}, **result}
        (out_dir / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
        brief = {k: v for k, v in report.items() if k in ("rows", "auto_picks", "error")}
        print(f"{name}: {json.dumps(brief)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
