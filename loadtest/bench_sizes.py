"""Requests of sizes other than the compile warm-up's: what their first run costs.

The server compiles the repeated block once at load, at the probe size (832x480x81 on CUDA).
A request of another size then ran a graph made for one size: dynamo compiled again (its
automatic dynamic shapes) inside that request's first step, from inductor's caches where an
earlier process left them, or whole on a new machine. The warm-up now marks the token dims
symbolic (``service.models.compiled.mark_token_dims``): one graph for every size.

Each variant runs in its own process (dynamo's state is per process), one model load each:
``marked`` (the server as it is) and ``static`` (the marks turned off: the earlier warm-up),
each with its own empty inductor cache folder (``--cache cold``, a new machine) or the default
one (``--cache warm``). Per size, the same request twice: the first run's seconds and steps
against the second's, and dynamo's graph count before and after.

    python loadtest/bench_sizes.py --model /tmp/wan12 --out loadtest/results/h200-sizes-DATE.json
    python loadtest/bench_sizes.py --model /tmp/tiny --device cpu --sizes 48x32x9,32x48x5 --out /tmp/s.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from reporting import header, write_report

VARIANTS = ("marked", "static")


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    """One process: load with compile on, then each size's request twice."""
    import torch
    from torch._dynamo.utils import counters

    from service.config import EngineConfig, ModelConfig, OffloadConfig, OffloadMode
    from service.models import compiled
    from service.models.pipeline import PipelineRunner
    from service.models.request import GenerationRequest

    if args.variant == "static":
        compiled.mark_token_dims = lambda args, kwargs: 0  # the warm-up before the marks
    device = "cuda" if args.device == "cuda" else "cpu"
    probe = tuple(int(x) for x in args.probe.split("x")) if args.probe else None  # height x width x frames
    config = EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER, probe_shape=probe),
                          model=ModelConfig(compile="on"))
    t0 = time.perf_counter()
    runner = PipelineRunner.load(args.model, device, config=config)
    out: dict[str, Any] = {"load_s": round(time.perf_counter() - t0, 2),
                           "compile": runner.describe()["compile"], "sizes": []}

    def run(req: GenerationRequest) -> dict[str, Any]:
        steps: list[float] = []
        last = [time.perf_counter()]

        def on_step(step: int, total: int) -> None:
            now = time.perf_counter()
            steps.append(round(now - last[0], 4))
            last[0] = now

        graphs = int(counters["stats"]["unique_graphs"])
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        runner.frames(req, on_step)
        return {"s": round(time.perf_counter() - t, 3), "step_s": steps,
                "new_graphs": int(counters["stats"]["unique_graphs"]) - graphs}

    try:
        for size in args.sizes.split(","):
            w, h, f = (int(x) for x in size.split("x"))
            req = GenerationRequest(prompt="a red fox running through snow", seed=1, width=w, height=h,
                                    num_frames=f, num_inference_steps=args.steps)
            first, again = run(req), run(req)
            out["sizes"].append({"size": size, "first": first, "again": again,
                                 "first_over_again_s": round(first["s"] - again["s"], 3)})
            print(f"{args.variant} {size}: first {first['s']} s ({first['new_graphs']} new graphs), "
                  f"again {again['s']} s", flush=True)
    finally:
        runner.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--sizes", default="832x480x81,832x480x17,480x832x9,832x480x5,832x480x33",
                   help="WIDTHxHEIGHTxFRAMES of the requests, in order (the first: the warm-up's own size)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--probe", default=None, help="HEIGHTxWIDTHxFRAMES of the warm-up (default: the server's)")
    p.add_argument("--cache", choices=("cold", "warm"), default="cold",
                   help="cold: each variant an empty inductor cache folder (a new machine)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", required=True)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        Path(args.result).write_text(json.dumps(run_variant(args)))
        return 0
    report: dict[str, Any] = {**header(args.device), "cache": args.cache,
                              "steps": args.steps, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants.split(","):
            env = None
            if args.cache == "cold":
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / f"inductor-{name}")}
            result = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, __file__, "--model", args.model, "--device", args.device,
                   "--sizes", args.sizes, "--steps", str(args.steps), "--out", args.out, "--variant", name,
                   "--result", str(result)]
            if args.probe:
                cmd += ["--probe", args.probe]
            subprocess.run(cmd, check=True, env=env)
            report["variants"][name] = json.loads(result.read_text())
    v = report["variants"]
    if set(VARIANTS) <= set(v):  # the first runs' extra seconds, summed over the sizes
        report["first_runs_extra_s"] = {n: round(sum(s["first_over_again_s"] for s in v[n]["sizes"]), 3)
                                        for n in VARIANTS}
    print(json.dumps(report.get("first_runs_extra_s", {})))
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
