"""Step caches under offload: forward-seconds and bytes moved per request, per method and threshold.

One request (default 832x480, 33 frames, 10 steps, CFG: 20 transformer forwards) through
``PipelineRunner`` with DLO AllGather at DP1 on the Wan2.1-14B block shapes
(``dloserve demo-model --preset wan14b-shape``), once per cache setting: none, first_block
at two thresholds, mag at two thresholds. Per run: the seconds inside transformer forwards
(host wall time, synchronized after each forward), the request's seconds, the bytes the
offload moved (H2D, gathered, slot fills) and what it skipped (forwards stopped, blocks not
filled, bytes saved), and whether the frames equal the uncached ones. With ``--dp2`` also a
two-rank AllGather group (NCCL on GPU, gloo on CPU), rank 0 cached and rank 1 uncached, then
both cached: per-rank seconds, gathered bytes, and the cost of the per-forward agreement
(``skip_agree_s / skip_decisions``, over the rank worker's gloo control group).

The demo weights are noise: how often a method skips here says nothing about quality or
about how often it skips on a trained checkpoint. MagCache needs the model's magnitude
ratios; without ``--mag-ratios`` a stand-in schedule is used (1.0, then 0.97 per step: the
error grows 3% a step, so the two thresholds skip differently); only the bytes and seconds
per skipped forward carry over to a real model, not how many forwards skip.

    python loadtest/bench_cache.py --out $OUT/h200-cache.json                 # one H200, ~10 min
    python loadtest/bench_cache.py --dp2 --out $OUT/h200x2-cache.json         # two H200s
    python loadtest/bench_cache.py --smoke                                    # CPU, tiny model
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from reporting import header, machine_kind, preset_model, result_path, write_report

from service.config import EngineConfig, ModelConfig, OffloadConfig, OffloadMode
from service.config.cache import CacheSpec

SYNTHETIC_RATIO = 0.97  # without --mag-ratios: a stand-in schedule (1.0, then 0.97 per step)
BYTES = ("h2d_bytes", "gathered_bytes", "fill_bytes", "fills", "forwards", "skips", "skip_decisions",
         "skip_overruled", "blocks_skipped", "blocks_reused", "fill_bytes_skipped", "skip_agree_s")


def settings_list(args: argparse.Namespace) -> list[tuple[str, CacheSpec]]:
    ratios = tuple(args.mag_ratios or [1.0] + [SYNTHETIC_RATIO] * (args.steps - 1))
    out = [("none", CacheSpec())]
    out += [(f"first_block@{t}", CacheSpec("first_block", threshold=t)) for t in args.fbc_thresholds]
    out += [(f"mag@{t}", CacheSpec("mag", threshold=t, max_skip_steps=args.mag_max_skip, mag_ratios=ratios))
            for t in args.mag_thresholds]
    return out


def _timed_forwards(runner: Any, dev: torch.device) -> tuple[list[float], list[Any]]:
    times: list[float] = []
    t0: list[float] = []

    def pre(_m: Any, _a: Any) -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0.append(time.perf_counter())

    def post(_m: Any, _a: Any, _o: Any) -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0.pop())

    hooks = [runner.transformer.register_forward_pre_hook(pre, prepend=True),
             runner.transformer.register_forward_hook(post, always_call=True)]
    return times, hooks


def run_request(runner: Any, req: Any, dev: torch.device) -> dict[str, Any]:
    before = runner.offload_stats() or {}
    times, hooks = _timed_forwards(runner, dev)
    t0 = time.perf_counter()
    try:
        frames = runner.frames(req)
    finally:
        for h in hooks:
            h.remove()
    after = runner.offload_stats() or {}
    out = {k: after.get(k, 0) - before.get(k, 0) for k in BYTES}
    out.update(seconds=round(time.perf_counter() - t0, 4), forward_s=round(sum(times), 4),
               forward_count=len(times), sha256=hashlib.sha256(frames.tobytes()).hexdigest())
    return out


def request_of(args: argparse.Namespace) -> Any:
    from service.models.request import GenerationRequest

    w, h, f = (int(v) for v in args.size.split("x"))
    return GenerationRequest(prompt="a red fox running through snow", seed=7, width=w, height=h, num_frames=f,
                             num_inference_steps=args.steps, guidance_scale=5.0)


def settings_of(args: argparse.Namespace) -> Any:
    return EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER), model=ModelConfig(dtype=args.dtype))


def dp1(args: argparse.Namespace) -> dict[str, Any]:
    from service.models.pipeline import PipelineRunner

    dev = torch.device(args.device)
    runner = PipelineRunner.load(args.model, dev, config=settings_of(args))
    req = request_of(args)
    try:
        run_request(runner, req, dev)  # warm-up: kernels, allocator, page cache
        runs = {name: run_request(runner, replace(req, cache=spec), dev)
                for name, spec in settings_list(args)}
    finally:
        runner.close()
    base = runs["none"]
    for r in runs.values():
        r["frames_equal_uncached"] = r["sha256"] == base["sha256"]
        r["forward_s_vs_none"] = round(r["forward_s"] / base["forward_s"], 3) if base["forward_s"] else None
        r["bytes_vs_none"] = round(r["fill_bytes"] / base["fill_bytes"], 3) if base["fill_bytes"] else None
    return runs


def _dp2_rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    from service.models.pipeline import PipelineRunner

    dev = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    runner = PipelineRunner.load(args.model, dev, config=settings_of(args), group=dist.group.WORLD)
    control = dist.new_group(backend="gloo")  # what the rank worker agrees over
    runner.caches.agree_over(control)
    req = request_of(args)
    spec = dict(settings_list(args))[args.dp2_cache]
    out: dict[str, Any] = {}
    try:
        run_request(runner, req, dev)
        for name, mine in (("rank0_cached", spec if rank == 0 else CacheSpec()), ("both_cached", spec)):
            dist.barrier(control)
            out[name] = run_request(runner, replace(req, cache=mine), dev)
    finally:
        runner.close()
    # the all-reduce alone (a decision's time in a forward adds the wait for the slower rank)
    flag, times = torch.zeros(1, dtype=torch.int32), []
    dist.barrier(control)
    for _ in range(200):
        t0 = time.perf_counter()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control)
        times.append(time.perf_counter() - t0)
    out["allreduce_us_median"] = round(1e6 * sorted(times)[len(times) // 2], 1)
    return out


def dp2(args: argparse.Namespace) -> dict[str, Any]:
    from ranks import run_ranks

    results = run_ranks(_dp2_rank, 2, args, timeout=None, backend="nccl" if args.device == "cuda" else "gloo")
    out: dict[str, Any] = {"cache": args.dp2_cache,
                           "gloo_allreduce_us_median": max(r["allreduce_us_median"] for r in results)}
    for name in ("rank0_cached", "both_cached"):
        per = [r[name] for r in results]
        dec = max(p["skip_decisions"] for p in per)
        out[name] = {"ranks": per, "agree_ms_per_decision": round(
            1000 * max(p["skip_agree_s"] for p in per) / dec, 4) if dec else None}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default="wan14b-shape")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--model", help="a Wan pipeline folder; default: write the preset to a temp dir (reused)")
    p.add_argument("--size", default="832x480x33", help="WIDTHxHEIGHTxFRAMES")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtype", default=None, help="cast at load (default bfloat16 on CUDA)")
    p.add_argument("--fbc-thresholds", type=lambda s: [float(v) for v in s.split(",")], default=[0.05, 0.2])
    p.add_argument("--mag-thresholds", type=lambda s: [float(v) for v in s.split(",")], default=[0.06, 0.24])
    p.add_argument("--mag-max-skip", type=int, default=3)
    p.add_argument("--mag-ratios", type=lambda s: [float(v) for v in s.split(",")], default=None)
    p.add_argument("--dp2", action="store_true", help="also a two-rank AllGather group (2 GPUs on CUDA)")
    p.add_argument("--dp2-cache", default="first_block@0.2", help="the setting the DP2 runs use")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny preset, 3 layers, 32x32x5, 4 steps")
    p.add_argument("--out", help="JSON path; default <kind>-cache-<date>.json in $OUT, else "
                                 "loadtest/results/")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.preset, args.layers, args.size, args.steps = "cpu", "tiny", 3, "32x32x5", 4
        args.fbc_thresholds = [0.05, 5.0]  # noise weights: a loose one that does skip
        args.dp2_cache = "first_block@5.0"
    if args.dtype is None and args.device == "cuda":
        args.dtype = "bfloat16"
    t_start = time.perf_counter()
    args.model = args.model or str(preset_model(args.preset, args.layers, args.device))
    report: dict[str, Any] = {
        **header(args.device),
        "model": {"preset": args.preset, "layers": args.layers, "path": args.model},
        "request": {"size": args.size, "steps": args.steps, "cfg": True},
        "note": "demo weights are noise: skip rates say nothing about quality or trained checkpoints",
        "dp1": dp1(args)}
    if args.dp2:
        report["dp2"] = dp2(args)
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    out = Path(args.out or result_path(report, machine_kind(report, args.device), "cache"))
    write_report(report, out)
    for name, r in report["dp1"].items():
        print(f"{name:18s} forward {r['forward_s']:8.3f} s ({r['forward_s_vs_none']}x)  fills "
              f"{r['fill_bytes'] / 2**20:9.1f} MiB ({r['bytes_vs_none']}x)  skipped {r['blocks_skipped']:4d} "
              f"blocks in {r['skips']:3d} stops  frames==none: {r['frames_equal_uncached']}")
    if args.dp2:
        for name in ("rank0_cached", "both_cached"):
            d = report["dp2"][name]
            print(f"dp2 {name:13s} " + "  ".join(
                f"rank{i} {r['forward_s']:.3f} s {r['gathered_bytes'] / 2**20:.1f} MiB skips {r['skips']}"
                for i, r in enumerate(d["ranks"])) + f"  agree {d['agree_ms_per_decision']} ms/decision")
        print(f"dp2 gloo all-reduce alone: {report['dp2']['gloo_allreduce_us_median']} us (median of 200)")
    print(f"wrote {out} ({report['seconds']:.0f} s)")
    # a run that skipped nothing must give the uncached frames (the caches' threshold-0 rule)
    return 0 if all(r["frames_equal_uncached"] for r in report["dp1"].values() if r["skips"] == 0) else 1


if __name__ == "__main__":
    sys.exit(main())
