"""FP8 weights against bf16 on one GPU: resident and DLO, upcast and scaled_mm, side by side.

One command, one checkpoint (the Wan2.1-14B block shapes from ``dloserve demo-model
--preset wan14b-shape``): bf16 resident, bf16 DLO (AllGather DP1), FP8 resident and FP8
DLO, each in its own process (clean host and device peaks). FP8 is quantized online at
load from the same bf16 checkpoint (``--fp8-source online``), or read from a folder that
``dloserve quantize`` writes once (``prequantized``; it also adds the rank-local run from
the page cache, ``fp8-ranklocal``). An FP8 process measures both computes on the same
weights. Per run and workload: median forward, ratio to bf16 resident, device peak, H2D
bytes and stall per forward, host PSS growth and pinned bytes, the output's SHA-256 and its
relative L2 error against bf16 resident, and the issue's targets checked.

    python loadtest/bench_fp8.py --layers 40 --out $OUT/h200-fp8.json              # H200, ~5 min
    python loadtest/bench_fp8.py --device cpu --preset tiny --layers 3 --tokens 64 \\
        --reps 1 --dtype bfloat16 --out /tmp/fp8.json                                 # smoke
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import reporting
import torch
from offload_strategies import _keep_fp32, _meta_transformer

RUNS = ("bf16-resident", "bf16-dlo", "fp8-resident", "fp8-dlo")
COMPUTES = ("upcast", "scaled_mm")
TARGETS = {4096: 1.15, 32760: 1.0}  # FP8 DLO over bf16 resident (issue 23)


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """Load one run's transformer, time every compute x workload, save the first outputs."""

    from service.offload import enable_layerwise_offload, load_resident
    from service.offload.quant import set_compute

    dev = torch.device(args.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
    run = args.worker
    fp8 = run.startswith("fp8")
    folder = Path(args.fp8_model if fp8 and args.fp8_model else args.model) / "transformer"
    dtype = getattr(torch, args.dtype) if args.dtype else None
    keep = _keep_fp32() if dtype is not None else ()
    before = reporting.host_memory()
    t0 = time.perf_counter()
    module, handle = _meta_transformer(folder), None
    q = "fp8" if fp8 else None
    if run.endswith("resident"):
        load_resident(module, folder, dev, dtype=dtype, keep_fp32=keep, quantization=q,
                      block_attrs=["blocks"])
    else:
        handle = enable_layerwise_offload(module, folder, device=dev, block_attrs=["blocks"], dtype=dtype,
                                          mode="rank-local" if run.endswith("ranklocal") else "allgather",
                                          keep_fp32=keep,
                                          quantization=q)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    res: dict[str, Any] = {"run": run, "load_s": time.perf_counter() - t0, "computes": {},
                           "host": {"after_load": reporting.host_memory()}}
    text_dim = json.loads((folder / "config.json").read_text())["text_dim"]
    x_dtype = module.patch_embedding.weight.dtype
    for compute in (args.computes if fp8 else ["bf16"]):
        if fp8:
            set_compute(module, compute, dev)
        out: dict[str, Any] = {"scaled_mm_ran": compute == "scaled_mm" and x_dtype == torch.bfloat16}
        try:
            for tokens in args.tokens:
                out[str(tokens)] = _workload(args, module, handle, dev, tokens, text_dim, x_dtype,
                                             Path(args.outputs) / f"{run}-{compute}-{tokens}.pt")
        except Exception as e:  # noqa: BLE001 - e.g. a compute the device lacks; the others still run
            out["error"] = repr(e)[-2000:]
        res["computes"][compute] = out
    res["host"]["end"] = reporting.host_memory()
    res["host"]["growth_pss_bytes"] = res["host"]["after_load"]["pss_bytes"] - before["pss_bytes"]
    if handle is not None:
        st = handle.stats()
        res["offload_stats"] = st.as_dict()
        res["host"]["pinned_bytes"] = st.host_pinned_bytes
        res["host"]["registered_bytes"] = st.host_registered_bytes
        handle.close()
    else:
        res["host"]["pinned_bytes"] = 0
    res["weight_bytes_on_device"] = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    return res


def _workload(args: argparse.Namespace, module: torch.nn.Module, handle: Any, dev: torch.device, tokens: int,
              text_dim: int, dtype: torch.dtype, save: Path) -> dict[str, Any]:
    x = reporting.inputs(tokens, text_dim, dev, dtype)
    reps = args.reps if tokens < 30000 else max(1, args.reps - 1)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    st0 = handle.stats() if handle else None
    times, digest = [], ""
    with torch.no_grad():
        for i in range(args.warmup + reps):
            with reporting.Timer(dev) as t:
                y = module(**x, return_dict=False)[0]
            if i == 0:
                first = y.float().cpu()
                digest = hashlib.sha256(first.numpy().tobytes()).hexdigest()
                torch.save(first, save)
            if i >= args.warmup:
                times.append(t.ms)
            del y
    w: dict[str, Any] = {"median_ms": statistics.median(times), "times_ms": times, "sha256": digest}
    if dev.type == "cuda":
        w["device_peak_bytes"] = torch.cuda.max_memory_allocated(dev)
    if handle is not None and st0 is not None:
        st = handle.stats()
        fwd = st.forwards - st0.forwards
        w["h2d_bytes_per_forward"] = (st.h2d_bytes - st0.h2d_bytes) / fwd
        w["stall_ms_per_forward"] = (st.stall_s - st0.stall_s) / fwd * 1e3
    return w


def compare(report: dict[str, Any], outputs: Path) -> None:
    """Ratios to bf16 resident, errors against its output, bitwise checks, the targets."""
    runs = report["runs"]
    base = runs.get("bf16-resident", {}).get("computes", {}).get("bf16", {})
    rows = []
    for name, r in runs.items():
        for compute, c in r.get("computes", {}).items():
            for tokens in report["tokens"]:
                w = c.get(str(tokens))
                if w is None:
                    continue
                ref = base.get(str(tokens))
                row = {"run": name, "compute": compute, "tokens": tokens, "median_ms": w["median_ms"],
                       "device_peak_gb": w.get("device_peak_bytes", 0) / 1e9,
                       "h2d_gb_per_forward": w.get("h2d_bytes_per_forward", 0) / 1e9,
                       "stall_ms_per_forward": w.get("stall_ms_per_forward"),
                       "host_pss_growth_gb": r["host"]["growth_pss_bytes"] / 1e9,
                       "pinned_gb": r["host"]["pinned_bytes"] / 1e9, "load_s": r["load_s"],
                       "host_shard_gb": r.get("offload_stats", {}).get("host_shard_bytes", 0) / 1e9,
                       "block_gb": r.get("offload_stats", {}).get("largest_block_bytes", 0) / 1e9}
                if ref:
                    row["x_bf16_resident"] = w["median_ms"] / ref["median_ms"]
                    row["rel_error_vs_bf16"] = _rel_error(outputs, name, compute, tokens)
                twin = runs.get(name.replace("dlo", "resident").replace("ranklocal", "resident"), {})
                tw = twin.get("computes", {}).get(compute, {}).get(str(tokens))
                if tw and twin is not r:
                    row["bitwise_equal_resident"] = tw["sha256"] == w["sha256"]
                rows.append(row)
    report["rows"] = rows
    report["targets"] = []
    for tokens, limit in TARGETS.items():
        fp8 = [r for r in rows if r["run"] == "fp8-dlo" and r["tokens"] == tokens and "x_bf16_resident" in r]
        for r in fp8:
            x = r["x_bf16_resident"]
            report["targets"].append({"tokens": tokens, "compute": r["compute"], "fp8_dlo_x_bf16_resident": x,
                                      "target": f"<= {limit}" if limit != 1.0 else "< 1.0",
                                      "met": x <= limit if limit != 1.0 else x < 1.0})
    pinned = {n: runs[n]["host"]["pinned_bytes"] for n in ("bf16-dlo", "fp8-dlo")
              if "host" in runs.get(n, {})}
    if len(pinned) == 2 and pinned["bf16-dlo"]:
        report["pinned_fp8_over_bf16"] = pinned["fp8-dlo"] / pinned["bf16-dlo"]


def _rel_error(outputs: Path, run: str, compute: str, tokens: int) -> float | None:
    a, b = outputs / f"{run}-{compute}-{tokens}.pt", outputs / f"bf16-resident-bf16-{tokens}.pt"
    if not (a.is_file() and b.is_file()):
        return None
    y, ref = torch.load(a), torch.load(b)
    return float((y.double() - ref.double()).norm() / ref.double().norm())


def table(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [f"{m.get('gpu', 'CPU')}, {report['model']['preset']} x {report['model']['layers']} layers, "
             f"fp8 {report['fp8_source']}, {report['date'][:10]}", "",
             "| run | compute | tokens | median ms | x bf16 resident | rel. error | GPU peak GB | H2D GB/fwd "
             "| block GB | host shards GB | pinned GB | PSS growth GB | = resident |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        err = r.get("rel_error_vs_bf16")
        lines.append(f"| {r['run']} | {r['compute']} | {r['tokens']:,} | {r['median_ms']:.1f} "
                     f"| {r.get('x_bf16_resident', 0):.3f} | {'-' if err is None else f'{err:.2e}'} "
                     f"| {r['device_peak_gb']:.2f} | {r['h2d_gb_per_forward']:.2f} | {r['block_gb']:.3f} "
                     f"| {r['host_shard_gb']:.2f} | {r['pinned_gb']:.2f} "
                     f"| {r['host_pss_growth_gb']:.2f} | {r.get('bitwise_equal_resident', '')} |")
    return "\n".join(lines)


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    from service.models.demo import write_demo_model

    t_start = time.perf_counter()
    tmp = Path(tempfile.gettempdir())
    if args.model is None:
        args.model = str(tmp / f"dloserve-bench-{args.preset}-L{args.layers}")
        if not (Path(args.model) / "model_index.json").is_file():
            t0 = time.perf_counter()
            write_demo_model(args.model, args.preset, args.layers, init_device=args.device, progress=True)
            print(f"wrote {args.model} in {time.perf_counter() - t0:.0f} s", flush=True)
    prep: dict[str, Any] = {}
    if args.fp8_source == "prequantized":
        from service.models.quantize import quantize_pipeline

        args.fp8_model = args.model.rstrip("/") + "-fp8"
        if not (Path(args.fp8_model) / "model_index.json").is_file():
            prep["quantize"] = quantize_pipeline(args.model, args.fp8_model)
            print(f"quantized in {prep['quantize']['seconds']:.0f} s", flush=True)
    report: dict[str, Any] = {
        **reporting.header(args.device),
        "model": {"preset": args.preset, "layers": args.layers, "path": args.model,
                  "fp8_path": args.fp8_model},
        "fp8_source": args.fp8_source, "tokens": args.tokens, "reps": args.reps, "prepare": prep, "runs": {}}
    if args.device == "cuda":
        report["machine"]["pinned_h2d_gb_per_s"] = reporting.h2d_probe_in_subprocess()
    with tempfile.TemporaryDirectory(prefix="bench-fp8-") as outputs:
        for run in args.runs:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, __file__, "--worker", run, "--out", f.name, "--outputs", outputs,
                       *_forward_args(args)]
                t0 = time.perf_counter()
                try:
                    proc = subprocess.run(cmd, text=True, capture_output=True, timeout=args.timeout)
                    ok = proc.returncode == 0
                    err = proc.stderr[-3000:]
                except subprocess.TimeoutExpired:
                    ok, err = False, f"timed out after {args.timeout} s"
                report["runs"][run] = json.loads(Path(f.name).read_text()) if ok else {"error": err}
                print(f"{run}: {'done' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s"
                      + ("" if ok else f"\n{err}"), flush=True)
                print("RESULT " + json.dumps(report["runs"][run]), flush=True)  # kept if a later run hangs
        compare(report, Path(outputs))
    report["errors"] = {f"{n}/{c}": v["error"] for n, r in report["runs"].items()
                        for c, v in r.get("computes", {}).items() if "error" in v}
    report["seconds"] = time.perf_counter() - t_start
    return report


def _forward_args(args: argparse.Namespace) -> list[str]:
    out = ["--device", args.device, "--preset", args.preset, "--layers", str(args.layers),
           "--model", args.model, "--tokens", ",".join(map(str, args.tokens)), "--reps", str(args.reps),
           "--warmup", str(args.warmup), "--computes", ",".join(args.computes)]
    if args.fp8_model:
        out += ["--fp8-model", args.fp8_model]
    if args.dtype:
        out += ["--dtype", args.dtype]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default="wan14b-shape")
    p.add_argument("--layers", type=int, default=12, help="transformer blocks (40: the real Wan2.1-14B)")
    p.add_argument("--model", help="a Wan pipeline folder; default: write the preset to a temp dir (reused)")
    p.add_argument("--fp8-source", choices=("online", "prequantized"), default="online")
    p.add_argument("--fp8-model", help=argparse.SUPPRESS)
    p.add_argument("--tokens", type=reporting.token_list, default=[4096, 32760])
    p.add_argument("--runs", type=lambda s: s.split(","), default=None,
                   help=f"comma-separated from {','.join(RUNS)},fp8-ranklocal")
    p.add_argument("--computes", type=lambda s: s.split(","), default=list(COMPUTES))
    p.add_argument("--dtype", default=None, help="cast at load (e.g. bfloat16 for the fp32 CPU presets)")
    p.add_argument("--reps", type=int, default=3, help="timed forwards (one fewer at 32,760+ tokens)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=300, help="seconds per run's process")
    p.add_argument("--out", help="JSON path; default $OUT/bench_fp8.json, else "
                                 "loadtest/results/<kind>-fp8-<date>.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--outputs", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    reporting.check_tokens(p, args.tokens, reporting.SHAPES)
    if args.worker:
        Path(args.out).write_text(json.dumps(worker(args)))
        return 0
    if args.runs is None:
        args.runs = list(RUNS) + (["fp8-ranklocal"] if args.fp8_source == "prequantized" else [])
    report = run_all(args)
    kind = reporting.machine_kind(report, args.device)
    default = Path(os.environ["OUT"]) / "bench_fp8.json" if os.environ.get("OUT") else \
        reporting.RESULTS / f"{kind}-fp8-{report['date'][:10]}.json"
    out = Path(args.out or default)
    reporting.write_report(report, out)
    print(table(report))
    print(json.dumps({"targets": report["targets"], "errors": report["errors"]}, indent=1))
    print(f"wrote {out} ({report['seconds']:.0f} s)")
    return 1 if any("error" in r for r in report["runs"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
