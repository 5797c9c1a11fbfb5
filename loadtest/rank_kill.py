"""A rank SIGKILLed mid-request under `dloserve serve` with default flags: what fails, how
long until the service serves again, and that the next request completes.

    python loadtest/rank_kill.py --model /tmp/wan12 --dp 2 --out $OUT/rank-kill.json

It starts the service (only `--enable-distributed-layerwise-offload`: auto mode, auto
encoders), times start-up to ready, sends a long request, kills one rank process once the
request has made progress, and reports: the seconds from the kill to `/readyz` 200 (serving
again), the killed request's final status (by default it runs again on the rebuilt group)
and when it ended, the seconds to the next request's completion, and the group's cold-start
breakdown from the service log. ``--no-rank-standby`` rebuilds on new processes (no
standby) for the comparison; the JSON has /readyz's ``startup`` (the command to ready).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from reporting import header
from serving import final, start_serve, stop_serve, wait_ready

from service.api.hostproc import matching
from service.engine.ports import free_port


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--steps", type=int, default=20, help="steps of the request that is killed")
    p.add_argument("--size", default="832x480x33", help="WIDTHxHEIGHTxFRAMES of the requests")
    p.add_argument("--no-rank-standby", action="store_true",
                   help="serve --no-rank-standby: rebuild on new rank processes (the comparison)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "service.cli", "serve", args.model, "--data-parallel-size", str(args.dp),
           "--enable-distributed-layerwise-offload", "--port", str(port), "--max-steps", "1000"]
    if args.device == "cpu":
        cmd += ["--gpus-per-rank", "0", "--cpus-per-rank", "0.5"]
    if args.no_rank_standby:
        cmd += ["--no-rank-standby"]
    log_path = Path(args.out).with_suffix(".log")
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    t0 = time.monotonic()
    proc = start_serve(cmd, log, env)
    res: dict[str, Any] = header()
    try:
        res["ready_s"] = round(wait_ready(url, 900), 1)
        w, h, f = (int(x) for x in args.size.split("x"))
        body = {"prompt": "killed mid-request", "seed": 1, "width": w, "height": h, "num_frames": f,
                "num_inference_steps": args.steps}
        warm = httpx.post(f"{url}/v1/videos", json={**body, "num_inference_steps": 1, "prompt": "warm-up"},
                          timeout=60).json()["id"]
        res["warm_up"] = final(url, warm, 900)["status"]
        vid = httpx.post(f"{url}/v1/videos", json=body, timeout=60).json()["id"]
        while httpx.get(f"{url}/v1/videos/{vid}", timeout=30).json()["progress"] < 10:
            time.sleep(0.1)
        ranks = matching(proc.pid, "RankActor")  # never a standby (its class is StandbyRank)
        res["rank_processes"] = len(ranks)
        t_kill = time.monotonic()
        os.kill(ranks[-1], signal.SIGKILL)
        time.sleep(0.5)  # the rebuild is under way by now; time until /readyz says it serves again
        res["kill_to_ready_s"] = round(0.5 + wait_ready(url, 600), 2)
        killed = final(url, vid, 900)  # by default it runs again on the rebuilt group (--job-retries 1)
        why = (killed.get("error") or {}).get("message")
        res["killed_request"] = {"status": killed["status"], "reason": why,
                                 "kill_to_final_s": round(time.monotonic() - t_kill, 2)}
        after = httpx.post(f"{url}/v1/videos", json={**body, "num_inference_steps": 2, "prompt": "after"},
                           timeout=60).json()["id"]
        nxt = final(url, after, 900)
        res["next_request"] = {"status": nxt["status"], "timings": nxt.get("timings")}
        res["kill_to_next_completed_s"] = round(time.monotonic() - t_kill, 2)
        res["readyz"] = httpx.get(f"{url}/readyz", timeout=30).json()
    finally:
        stop_serve(proc, log, 120)
        res["total_s"] = round(time.monotonic() - t0, 1)
    res["group_starts"] = [line.strip()[-900:] for line in log_path.read_text().splitlines()
                           if re.search(r"group \w+ gen \d+ ready in", line)]
    res["last_start"] = [g.get("last_start") for g in res.get("readyz", {}).get("groups", [])]
    res["startup"] = res.get("readyz", {}).get("startup")  # the command to ready, step by step
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("ready_s", "killed_request", "kill_to_ready_s", "next_request",
                                          "kill_to_next_completed_s", "last_start", "startup") if k in res},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
