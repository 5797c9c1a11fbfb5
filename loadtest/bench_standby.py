"""A rank SIGKILLed mid-request, with and without standbys: the rebuild's time and its parts.

    python loadtest/bench_standby.py --model /tmp/wan12 --device cuda --out $OUT/standby.json

The Ray executor under the real dispatcher in this process (no HTTP; ``loadtest/rank_kill.py``
measures through ``dloserve serve``): one rank, default offload mode for the device. For
each of standby on and off it starts the group, waits for the standby to have imported,
sends a request, kills the rank's process at the request's first step, and times the kill
to the group ready again and to the rerun request's end. It records each start's
breakdown (``last_start``: actor start and imports, process group, load) and whether the
rebuilt rank's pid is the standby's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from service.config import (
    EngineConfig,
    OffloadConfig,
    OffloadMode,
    ParallelConfig,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for tests.fakes (the in-memory executor); service is installed
from loadtest.reporting import header  # noqa: E402


def run_one(model: str, device: str, standby: bool, steps: int) -> dict[str, Any]:
    from service.engine.executor import GroupState
    from service.models.request import GenerationRequest
    from service.router.build import build_dispatcher
    from service.router.policy import DeadlinePolicy
    from tests.fakes import RecordingSink

    gpus = 1.0 if device == "cuda" else 0.0
    parallel = ParallelConfig(cpus_per_rank=0.5 if not gpus else 1.0, gpus_per_rank=gpus,
                              rank_standby=standby)
    spec = EngineConfig(model, parallel=parallel, offload=OffloadConfig(OffloadMode.ALLGATHER))
    sink = RecordingSink()
    d = build_dispatcher(spec, sink, deadlines=DeadlinePolicy(base_s=1800))
    t0 = time.monotonic()
    d.start()
    out: dict[str, Any] = {"standby": standby}
    try:
        with d._cv:
            assert d._cv.wait_for(lambda: d.status()["state"] == "ready", 900), d.status()
        out["first_ready_s"] = round(time.monotonic() - t0, 2)
        (group,) = d.executor._groups.values()
        out["first_start"] = group.started
        spare = None
        if standby:
            import ray

            t_sb = time.monotonic()
            while not d.executor._standbys.get(group.info.id):
                time.sleep(0.2)
            (actor, _), = d.executor._standbys[group.info.id]
            spare = ray.get(actor.started.remote(), timeout=900)
            out["standby_ready_after_group_s"] = round(time.monotonic() - t_sb, 2)
            out["standby_import_s"] = spare["import_s"]
        req = GenerationRequest(prompt="killed", seed=1, num_inference_steps=steps)
        d.submit("k", req.compat_key(), req)
        sink.wait_progress("k", timeout=900)
        t_kill = time.monotonic()
        os.kill(group.started["pids"][0], signal.SIGKILL)
        with d._cv:
            assert d._cv.wait_for(lambda: group.generation == 1 and group.state is GroupState.READY, 900)
        out["kill_to_ready_s"] = round(time.monotonic() - t_kill, 2)
        res = sink.wait(["k"], timeout=900)[0]
        out["kill_to_rerun_done_s"] = round(time.monotonic() - t_kill, 2)
        out["rerun_ok"] = res.ok
        out["rebuild"] = group.started
        out["rebuilt_pid_is_standby"] = bool(spare) and group.started["pids"] == [spare["pid"]]
    finally:
        d.stop()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import ray

    for attempt in (1, 2, 3):  # a loaded host can miss Ray's 30 s raylet registration
        try:
            ray.init(address="local", include_dashboard=False, log_to_driver=False)
            break
        except Exception:  # noqa: BLE001
            ray.shutdown()
            if attempt == 3:
                raise
    res: dict[str, Any] = {**header(args.device), "runs": []}
    try:
        for standby in (True, False):
            res["runs"].append(run_one(args.model, args.device, standby, args.steps))
            run = res["runs"][-1]
            print(json.dumps({k: v for k, v in run.items() if not k.endswith("start")}), flush=True)
    finally:
        res["load_avg_end"] = os.getloadavg()
        Path(args.out).write_text(json.dumps(res, indent=1))
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
