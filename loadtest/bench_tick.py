"""What the per-forward agreement of continuous scheduling costs (two gloo ranks, CPU).

    python loadtest/bench_tick.py --out loadtest/results/cpu-tick-DATE.json

Before every transformer forward the ranks of an AllGather group all-reduce two bits over
a gloo group (engine/rank.py). This runs two real ranks of the tiny demo model, rank 0
with one long request (2 x steps forwards), rank 1 replaying, and reports the time each
rank spent in the agreement per tick. The time includes waiting for the other rank to
arrive, so it is an upper bound on the protocol's own cost. The protocol alone is then
timed as back-to-back agreements with nothing else to do (``--calls`` of them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch.distributed as dist
from ranks import run_ranks
from reporting import header, write_report

from service.config import EngineConfig, OffloadConfig, OffloadMode
from service.engine.events import EventKind
from service.engine.rank import RankWorker
from service.engine.start import control_group
from service.models.demo import ensure_demo_model
from service.models.pipeline import PipelineRunner
from service.models.request import GenerationRequest


def _rank(rank: int, world: int, model: str, steps: int, calls: int) -> dict:
    settings = EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER))
    runner = PipelineRunner.load(model, "cpu", config=settings, group=dist.group.WORLD)
    worker = RankWorker(runner, rank, world, control_group(world))
    done = threading.Event()
    if rank == 0:
        worker.assign("long", GenerationRequest(prompt="ticks", num_inference_steps=steps))

        def pump() -> None:
            while not any(e.kind is EventKind.FINISHED for e in worker.events(1.0)):
                pass
            done.set()

        threading.Thread(target=pump, daemon=True).start()
    served = worker.serve()
    if rank == 0:
        done.wait(120)
    st = worker.status()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        worker._agree(True, True)
        times.append(time.perf_counter() - t0)
    worker.close()
    runner.close()
    return {"rank": rank, "ticks": st["ticks"], "agree_s": st["agree_s"], "serve_s": served["seconds"],
            "alone_median_us": round(statistics.median(times) * 1e6, 1),
            "alone_p99_us": round(sorted(times)[int(0.99 * len(times))] * 1e6, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    model = str(ensure_demo_model())
    ranks = run_ranks(_rank, 2, model, args.steps, args.calls, timeout=600)
    per_tick = [r["agree_s"] / r["ticks"] * 1e6 for r in ranks]
    res = {
        **header(),
        "ranks": ranks,
        "agree_us_per_tick": [round(x, 1) for x in per_tick],
        "agree_share_of_serve": [round(r["agree_s"] / r["serve_s"], 4) for r in ranks],
        "mean_agree_us_in_serve": round(statistics.mean(per_tick), 1),
        "alone_median_us": max(r["alone_median_us"] for r in ranks),
    }
    write_report(res, args.out)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
