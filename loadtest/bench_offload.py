"""Offload benchmark: dloserve vs resident vs diffusers group offload vs FSDP2 CPU offload.

One command runs every strategy on the same transformer and inputs, each in its own
process (clean host and device peaks), and writes one JSON with ratios to resident:

    python loadtest/bench_offload.py --device cuda --preset wan14b-shape --layers 12
    python loadtest/bench_offload.py --device cpu --preset tiny --tokens 64 --reps 2   # smoke

Per strategy and workload: median transformer forward (ms), ratio to resident, achieved
H2D GB/s (weight bytes moved per forward / forward time), weight-stall time per
forward, torch.cuda.max_memory_allocated, host RSS/PSS growth, pinned bytes, and the
SHA-256 of the output (bitwise equality with resident).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from offload_strategies import CPU_STRATEGIES, STRATEGIES, load
from reporting import (
    Timer,
    h2d_probe_in_subprocess,
    header,
    host_memory,
    inputs,
    machine_kind,
    preset_model,
    result_path,
    token_list,
    write_report,
)


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """Load one strategy, run every workload, return its figures."""
    from service.offload.checkpoint import Checkpoint

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    folder = Path(args.model) / "transformer"
    before = host_memory()
    t0 = time.perf_counter()
    module, handle = load(args.worker, folder, device)
    load_s = time.perf_counter() - t0
    after_load = host_memory()
    text_dim = json.loads((folder / "config.json").read_text())["text_dim"]
    dtype = torch.bfloat16 if args.preset == "wan14b-shape" else torch.float32
    weight_bytes = Checkpoint(folder).nbytes
    res: dict[str, Any] = {"strategy": args.worker, "load_s": load_s, "workloads": {}}
    for tokens in args.tokens:
        x = inputs(tokens, text_dim, device, dtype)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times, digest = [], None
        st0 = handle.stats() if handle else None
        reps = args.reps if tokens < 70000 else max(2, args.reps // 2)
        with torch.no_grad():  # not inference_mode: FSDP2 bumps version counters
            for i in range(args.warmup + reps):
                with Timer(device) as t:
                    out = module(**x, return_dict=False)[0]
                if i == 0:
                    digest = hashlib.sha256(out.float().cpu().numpy().tobytes()).hexdigest()
                if i >= args.warmup:
                    times.append(t.ms)
                del out
        st1 = handle.stats() if handle else None
        median = statistics.median(times)
        w: dict[str, Any] = {"median_ms": median, "times_ms": times, "sha256": digest}
        if device.type == "cuda":
            w["device_peak_bytes"] = torch.cuda.max_memory_allocated()
        if st0 is not None and st1 is not None:
            fwd = st1.forwards - st0.forwards
            w["stall_ms_per_forward"] = (st1.stall_s - st0.stall_s) / fwd * 1000
            w["h2d_bytes_per_forward"] = (st1.h2d_bytes - st0.h2d_bytes) / fwd
        if args.worker != "resident":
            moved = w.get("h2d_bytes_per_forward", weight_bytes)
            w["h2d_gb_per_s"] = moved / (median / 1000) / 1e9
        res["workloads"][str(tokens)] = w
    end = host_memory()
    res["host"] = {"before": before, "after_load": after_load, "end": end,
                   "growth_pss_bytes": end["pss_bytes"] - before["pss_bytes"]}
    res["checkpoint_bytes"] = weight_bytes
    if handle is not None:
        res["offload_stats"] = handle.stats().as_dict()
    if device.type == "cuda":
        res["host"]["cuda_host_alloc"] = _host_alloc_stats()
    return res


def _host_alloc_stats() -> dict[str, int]:
    try:
        s = torch.cuda.host_memory_stats()
    except (AttributeError, RuntimeError):
        return {}
    return {k: v for k, v in s.items() if "allocated_bytes" in k or "reserved_bytes" in k}


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    args.model = args.model or str(preset_model(args.preset, args.layers))
    results: dict[str, Any] = {}
    for strategy in args.strategies:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, __file__, "--worker", strategy, "--out", f.name]
            cmd += _forward_args(args)
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, text=True, capture_output=True, timeout=args.timeout)
            if proc.returncode != 0:
                results[strategy] = {"error": proc.stderr[-3000:]}
                print(f"{strategy}: FAILED\n{proc.stderr[-3000:]}", flush=True)
                continue
            results[strategy] = json.loads(Path(f.name).read_text())
            print(f"{strategy}: done in {time.perf_counter() - t0:.0f} s", flush=True)
            print("RESULT " + json.dumps(results[strategy]), flush=True)  # kept if a later one hangs
    model = {"preset": args.preset, "layers": args.layers, "path": args.model}
    report = {**header(args.device), "model": model, "tokens": args.tokens, "strategies": results}
    if args.device == "cuda":
        report["machine"]["pinned_h2d_gb_per_s"] = h2d_probe_in_subprocess()
    _compare(report)
    return report


def _forward_args(args: argparse.Namespace) -> list[str]:
    return ["--device", args.device, "--preset", args.preset, "--layers", str(args.layers),
            "--model", args.model, "--tokens", ",".join(map(str, args.tokens)),
            "--reps", str(args.reps), "--warmup", str(args.warmup)]


def _compare(report: dict[str, Any]) -> None:
    """Ratios to resident and bitwise equality, added to each workload."""
    res = report["strategies"]
    base = res.get("resident", {}).get("workloads", {})
    for r in res.values():
        for tokens, w in r.get("workloads", {}).items():
            ref = base.get(tokens)
            if ref:
                w["ratio_to_resident"] = w["median_ms"] / ref["median_ms"]
                w["bitwise_equal_resident"] = w["sha256"] == ref["sha256"]


def table(report: dict[str, Any]) -> str:
    """A Markdown table of the report (the README's table is made with this)."""
    probe = report["machine"].get("pinned_h2d_gb_per_s")
    lines = [f"{report['machine'].get('gpu', 'CPU')}, {report['model']['preset']} x "
             f"{report['model']['layers']} layers, {report['date'][:10]}"
             + (f", pinned H2D probe {probe:.1f} GB/s" if probe else ""), "",
             "| strategy | tokens | median ms | x resident | H2D GB/s | stall ms/fwd | GPU peak GB "
             "| host PSS growth GB | bitwise = resident |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["strategies"].items():
        if "error" in r:
            lines.append(f"| {name} | - | failed | | | | | | |")
            continue
        growth = r["host"]["growth_pss_bytes"] / 1e9
        for tokens, w in r["workloads"].items():
            peak = w.get("device_peak_bytes")
            lines.append(
                f"| {name} | {int(tokens):,} | {w['median_ms']:.1f} | {w.get('ratio_to_resident', 1):.3f} "
                f"| {_f(w.get('h2d_gb_per_s'))} | {_f(w.get('stall_ms_per_forward'))} "
                f"| {_f(peak / 1e9 if peak else None)} | {growth:.2f} "
                f"| {w.get('bitwise_equal_resident', '')} |")
    return "\n".join(lines)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default="wan14b-shape")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--model", help="a Wan pipeline folder; default: write the demo preset to a temp dir")
    p.add_argument("--tokens", type=token_list, default=[4096, 32760, 75600])
    p.add_argument("--strategies", type=lambda s: s.split(","), default=None)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", help="JSON path; default loadtest/results/<gpu|cpu>-<date>.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        Path(args.out).write_text(json.dumps(worker(args)))
        return 0
    args.strategies = args.strategies or list(STRATEGIES if args.device == "cuda" else CPU_STRATEGIES)
    report = run_all(args)
    out = Path(args.out or result_path(report, machine_kind(report, args.device)))
    write_report(report, out)
    print(table(report))
    print(f"wrote {out}")
    failed = [n for n, r in report["strategies"].items() if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
