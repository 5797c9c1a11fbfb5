"""Sequence parallel (Ulysses) with DLO: one request's forward on S GPUs against one GPU.

Runs, each in its own processes (one per GPU, NCCL; gloo on CPU):
  dp1-dlo       one GPU, layerwise offload (bitwise equal to resident in earlier runs)
  sp2-dlo       one SP group of 2: tokens split 2 ways, each rank holds 1/2 of the host copy
  sp2-resident  the same SP group with the whole transformer on each GPU
Per run and token count: median forward (ms), ratio to dp1-dlo, the device time of the
AllGather and all-to-all kernels over one profiled forward (their share of the step; the
AllGathers run on a side stream beside compute, the all-to-alls on the compute stream),
weight stall, device peak per rank, host PSS and pinned bytes per rank, and the SHA-256 of
the forward output. Then one short generation (default 480x832x81, 2 steps, CFG) per run:
SHA-256 of the uint8 frames, and against dp1-dlo the largest difference and the PSNR.

    python loadtest/bench_sp.py --preset wan14b-shape --layers 40          # 2 GPUs
    python loadtest/bench_sp.py --device cpu --preset tiny --layers 3 --tokens 64 --gen 32x32x5  # smoke
"""

from __future__ import annotations

import argparse
import hashlib
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from ranks import run_ranks
from reporting import header, host_memory, inputs, preset_model, result_path, token_list, write_report

from service.config import EngineConfig, OffloadConfig, OffloadMode

RUNS = {"dp1-dlo": (1, True), "sp2-dlo": (2, True), "sp2-resident": (2, False)}
PROFILED = ("sp2-dlo",)  # one extra forward each: the NCCL kernel times


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _comm_ms(module: torch.nn.Module, x: dict[str, torch.Tensor]) -> dict[str, float] | None:
    """Device time of NCCL kernels over one forward, by kind (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            module(**x, return_dict=False)
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - a missing CUPTI costs the shares, not the run
        print(f"profiler failed: {e}", flush=True)
        return None
    out = {"allgather_ms": 0.0, "all_to_all_ms": 0.0}
    for a in prof.key_averages():
        us = getattr(a, "self_device_time_total", None) or getattr(a, "self_cuda_time_total", 0.0)
        if "AllGather" in a.key:
            out["allgather_ms"] += us / 1000
        elif "SendRecv" in a.key or "AllToAll" in a.key:
            out["all_to_all_ms"] += us / 1000
    return out


def _rank(rank: int, world: int, model: str, offload: bool, device_kind: str, tokens: list[int],
          reps: int, gen: list[int] | None, scratch: str, run: str) -> dict[str, Any]:
    from service.models.pipeline import PipelineRunner
    from service.models.request import GenerationRequest

    dev = torch.device("cuda", rank) if device_kind == "cuda" else torch.device("cpu")
    t0 = time.perf_counter()
    settings = EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER if offload else OffloadMode.RESIDENT))
    runner = PipelineRunner.load(model, dev, config=settings,
                                 group=dist.group.WORLD if world > 1 else None, sequence_parallel=world)
    out: dict[str, Any] = {"load_s": time.perf_counter() - t0, "workloads": {},
                           "pss_after_load_bytes": host_memory()["pss_bytes"]}
    module = runner.transformer
    text_dim = module.config.text_dim
    dtype = next(module.patch_embedding.parameters()).dtype
    for n in tokens:
        x = inputs(n, text_dim, torch.device("cpu"), torch.float32)  # the same on every rank
        x = {k: (v.to(dev, dtype) if v.is_floating_point() else v.to(dev)) for k, v in x.items()}
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        with torch.inference_mode():
            _sync(dev)
            t = time.perf_counter()
            y = module(**x, return_dict=False)[0].float().cpu()  # warm-up, and the output we compare
            first_ms = (time.perf_counter() - t) * 1000
            if rank == 0:
                torch.save(y, f"{scratch}/{run}-{n}.pt")
            st0 = runner.offload_stats()
            times = []
            for _ in range(reps if offload or world == 1 else 1):  # resident SP: the equality check
                if world > 1:
                    dist.barrier()
                _sync(dev)
                t = time.perf_counter()
                module(**x, return_dict=False)
                _sync(dev)
                times.append(time.perf_counter() - t)
            st1 = runner.offload_stats()
            comm = _comm_ms(module, x) if dev.type == "cuda" and run in PROFILED else None
            if rank == 0:
                print(f"{run} {n} tokens: {[round(t * 1000) for t in times]} ms {comm or ''}", flush=True)
        out["workloads"][str(n)] = {
            "ms_per_forward": statistics.median(times) * 1000, "times_ms": [t * 1000 for t in times],
            "first_forward_ms": first_ms,
            "sha256": hashlib.sha256(y.numpy().tobytes()).hexdigest(),
            "stall_ms_per_forward": ((st1["stall_s"] - st0["stall_s"]) / reps * 1000) if st1 else None,
            "device_peak_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
            **(comm or {}),
        }
    stats = runner.offload_stats()
    out.update(host_pinned_bytes=stats["host_pinned_bytes"] if stats else 0,
               host_shard_bytes=stats["host_shard_bytes"] if stats else 0,
               pss_bytes=host_memory()["pss_bytes"])
    if gen:
        h, w, f = gen
        req = GenerationRequest(prompt="a red fox running through snow", seed=1, height=h, width=w,
                                num_frames=f, num_inference_steps=2, guidance_scale=5.0)
        _sync(dev)
        t = time.perf_counter()
        frames = runner.frames(req)
        _sync(dev)
        out["generate"] = {"seconds": time.perf_counter() - t, "request": f"{w}x{h}x{f}, 2 steps, CFG",
                           "sha256": hashlib.sha256(frames.tobytes()).hexdigest()}
        if rank == 0:
            np.save(f"{scratch}/{run}-frames.npy", frames)
    runner.close()
    return out


def compare(report: dict[str, Any], scratch: str) -> None:
    """Ratios to dp1-dlo, and how far each run's outputs are from it (bytes, max diff, PSNR)."""
    runs = {k: v for k, v in report["runs"].items() if "error" not in v}
    base = runs.get("dp1-dlo")
    for name, run in runs.items():
        lead = run["ranks"][0]
        for n, w in lead["workloads"].items():
            row = {"run": name, "tokens": int(n), "ms_per_forward": max(
                r["workloads"][n]["ms_per_forward"] for r in run["ranks"])}
            if base:
                b = base["ranks"][0]["workloads"][n]
                row["ratio_to_dp1"] = row["ms_per_forward"] / b["ms_per_forward"]
                row["bitwise_equal_dp1"] = w["sha256"] == b["sha256"]
                y = torch.load(f"{scratch}/{name}-{n}.pt")
                ref = torch.load(f"{scratch}/dp1-dlo-{n}.pt")
                row["max_abs_diff_dp1"] = float((y - ref).abs().max())
                row["rel_l2_diff_dp1"] = float((y - ref).norm() / ref.norm())
            if name == "sp2-dlo" and "sp2-resident" in runs:
                row["bitwise_equal_sp2_resident"] = (
                    w["sha256"] == runs["sp2-resident"]["ranks"][0]["workloads"][n]["sha256"])
            for key in ("allgather_ms", "all_to_all_ms"):
                if w.get(key) is not None:
                    row[key] = w[key]
                    row[key.replace("_ms", "_share")] = w[key] / row["ms_per_forward"]
            row["stall_ms_per_forward"] = w["stall_ms_per_forward"]
            row["device_peak_bytes_per_rank"] = [r["workloads"][n]["device_peak_bytes"] for r in run["ranks"]]
            row["host_pinned_bytes_per_rank"] = [r["host_pinned_bytes"] for r in run["ranks"]]
            row["pss_bytes_per_rank"] = [r["pss_bytes"] for r in run["ranks"]]
            report["summary"].append(row)
        if "generate" in lead:
            g = dict(lead["generate"], run=name)
            if base and "generate" in base["ranks"][0]:
                a = np.load(f"{scratch}/{name}-frames.npy").astype(np.float64)
                b = np.load(f"{scratch}/dp1-dlo-frames.npy").astype(np.float64)
                mse = float(((a - b) ** 2).mean())
                g.update(bitwise_equal_dp1=g["sha256"] == base["ranks"][0]["generate"]["sha256"],
                         max_abs_diff_dp1=float(np.abs(a - b).max()),
                         psnr_db_dp1=None if mse == 0 else 10 * math.log10(255.0**2 / mse))
            if name == "sp2-dlo" and "sp2-resident" in runs:
                g["bitwise_equal_sp2_resident"] = (
                    g["sha256"] == runs["sp2-resident"]["ranks"][0]["generate"]["sha256"])
            report["generate"].append(g)


def table(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [f"{m.get('gpu', 'CPU')}, {report['model']['preset']} x {report['model']['layers']} layers, "
             f"{report['date'][:10]}", "",
             "| run | tokens | ms/forward | x dp1 | AllGather share | all-to-all share | stall ms "
             "| GPU peak GB/rank | pinned GB/rank | bytes = dp1 | max abs diff |", "|---" * 11 + "|"]
    for r in report["summary"]:
        def pct(k: str, r: dict = r) -> str:
            return f"{100 * r[k]:.1f}%" if r.get(k) is not None else "-"
        peak = max((p or 0) for p in r["device_peak_bytes_per_rank"]) / 1e9
        lines.append(
            f"| {r['run']} | {r['tokens']:,} | {r['ms_per_forward']:.1f} | {r.get('ratio_to_dp1', 1):.3f} "
            f"| {pct('allgather_share')} | {pct('all_to_all_share')} | {r['stall_ms_per_forward'] or 0:.1f} "
            f"| {peak:.1f} | {max(r['host_pinned_bytes_per_rank']) / 1e9:.2f} "
            f"| {r.get('bitwise_equal_dp1')} | {r.get('max_abs_diff_dp1', 0):.3g} |")
    for g in report["generate"]:
        lines.append(f"generate {g['run']} ({g['request']}): {g['seconds']:.1f} s, bytes = dp1 "
                     f"{g.get('bitwise_equal_dp1')}, max diff {g.get('max_abs_diff_dp1')}, "
                     f"PSNR {g.get('psnr_db_dp1')}, = sp2-resident {g.get('bitwise_equal_sp2_resident')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default="wan14b-shape")
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--model", help="pipeline folder (default: write the preset under TMPDIR)")
    p.add_argument("--tokens", type=token_list, default=[75600, 32760])
    p.add_argument("--reps", type=int, default=2, help="timed forwards after one warm-up")
    p.add_argument("--gen", default="480x832x81", help="HxWxF of one 2-step generation, or 'none'")
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--run-timeout-s", type=float, default=900)
    p.add_argument("--out")
    args = p.parse_args(argv)
    args.model = args.model or str(preset_model(args.preset, args.layers))
    gen = None if args.gen == "none" else [int(v) for v in args.gen.split("x")]
    backend = "nccl" if args.device == "cuda" else "gloo"
    report: dict[str, Any] = {
        **header(args.device), "model": {"preset": args.preset, "layers": args.layers},
        "reps": args.reps, "runs": {}, "summary": [], "generate": [],
    }
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.runs.split(","):
            world, offload = RUNS[name]
            t = time.perf_counter()
            try:
                ranks = run_ranks(_rank, world, args.model, offload, args.device, args.tokens, args.reps,
                                  gen, scratch, name, timeout=args.run_timeout_s, backend=backend)
            except RuntimeError as e:  # one failed run must not lose the others' numbers
                report["runs"][name] = {"error": str(e)[-3000:]}
                print(f"{name} failed: {str(e)[-3000:]}", flush=True)
                continue
            report["runs"][name] = {"world": world, "sequence_parallel": world, "offload": offload,
                                    "ranks": ranks, "seconds": time.perf_counter() - t}
            print(f"{name}: {time.perf_counter() - t:.0f} s", flush=True)
        compare(report, scratch)
    kind = "h200x2" if "H200" in report["machine"].get("gpu", "") else args.device
    out = Path(args.out or result_path(report, kind, "sp"))
    write_report(report, out)
    print(table(report))
    print(f"wrote {out}")
    sp = [r for r in report["summary"] if r["run"] == "sp2-dlo" and "bitwise_equal_sp2_resident" in r]
    failed = [n for n, r in report["runs"].items() if "error" in r]
    return 0 if not failed and all(r["bitwise_equal_sp2_resident"] for r in sp) else 1


if __name__ == "__main__":
    sys.exit(main())
