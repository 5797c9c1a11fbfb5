"""Two checkouts' start paths side by side: `dloserve serve` to ready, and a killed rank's time
to serving again, one run, the starts interleaved (before, after, before, after: the same load).

    OMP_NUM_THREADS=1 python loadtest/bench_start_path.py --before /work/main --after . \\
        --rounds 2 --out loadtest/results/cpu-start-path-2026-12-04.json

A ``ready`` start is the README's command on the default (demo) model, on CPU ranks:
``dloserve serve --data-parallel-size 2 --enable-distributed-layerwise-offload`` (plus
``--gpus-per-rank 0 --cpus-per-rank 0.5``); ready is ``/readyz`` 200, timed from before the
exec. A ``kill`` start serves one rank with ``--rank-standby`` (a one-process group: its
standby loads ahead), runs a request, waits for the standby to have loaded, then SIGKILLs the
rank mid-request: ``kill_to_serving_s`` is the kill to ``/readyz`` 200 on a new generation
(loadtest/bench_startup.py's ``kill_run``). Each checkout runs with its own virtualenv's Python
from its own folder.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_startup import kill_run, readyz, stop, wait_ready
from reporting import Timer, header, write_report

from service.engine.ports import free_port

READY_ARGS = ["--data-parallel-size", "2", "--enable-distributed-layerwise-offload"]
KILL_ARGS = ["--data-parallel-size", "1", "--enable-distributed-layerwise-offload", "--rank-standby"]
CPU_ARGS = ["--gpus-per-rank", "0", "--cpus-per-rank", "0.5"]


def one_start(checkout: Path, kind: str, log: Path, timeout: float) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    python = checkout / ".venv" / "bin" / "python"
    cmd = [str(python), "-m", "service.cli", "serve", *(READY_ARGS if kind == "ready" else KILL_ARGS),
           *CPU_ARGS, "--port", str(port), "--results-dir", tempfile.mkdtemp(prefix="start-path-")]
    res: dict[str, Any] = {"checkout": str(checkout), "kind": kind, "command": shlex.join(cmd)}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(checkout)}
    with open(log, "w") as f:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=checkout, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            wait_ready(url, proc, timeout)
            res["command_to_ready_s"] = round(time.monotonic() - t0, 2)
            res["startup"] = readyz(url)[1].get("startup")
            if kind == "kill":
                body = {"prompt": "own time", "seed": 1, "width": 64, "height": 64, "num_frames": 5,
                        "num_inference_steps": 40}
                got = kill_run(url, proc, body, timeout, kill_at=25)
                res.update({k: got[k] for k in ("kill_to_serving_s", "standbys_loaded", "own_request")})
                res["killed_status"] = got["killed_request"]["status"]
                res["rebuild"] = got["rebuild"]
        except Exception as e:  # noqa: BLE001 - recorded; the next start still runs
            res["error"] = f"{type(e).__name__}: {e}"
        finally:
            stop(proc)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", required=True, help="the checkout before (its .venv runs it)")
    p.add_argument("--after", required=True, help="the checkout after")
    p.add_argument("--rounds", type=int, default=2, help="ready starts per checkout (one kill start each)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    sides = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    report: dict[str, Any] = {**header("cpu"), "starts": []}
    for side, checkout in sides.items():
        report[f"{side}_commit"] = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"],
                                                  capture_output=True, text=True).stdout.strip()
    logs = Path(tempfile.mkdtemp(prefix="start-path-logs-"))
    kinds = ["ready"] * args.rounds + ["kill"]
    with Timer("cpu") as total:
        for n, kind in enumerate(kinds):
            for side, checkout in sides.items():
                res = one_start(checkout, kind, logs / f"{n}-{side}-{kind}.log", args.timeout)
                report["starts"].append({"side": side, **res})
                print(side, kind, res.get("command_to_ready_s"), res.get("kill_to_serving_s"),
                      res.get("error", ""), flush=True)
    report["seconds"] = round(total.ms / 1000, 1)
    summary: dict[str, Any] = {}
    for side in sides:
        ready = [s["command_to_ready_s"] for s in report["starts"]
                 if s["side"] == side and s["kind"] == "ready" and "command_to_ready_s" in s]
        kills = [s["kill_to_serving_s"] for s in report["starts"]
                 if s["side"] == side and s["kind"] == "kill" and "kill_to_serving_s" in s]
        summary[side] = {"ready_s": ready, "ready_median_s": statistics.median(ready) if ready else None,
                         "kill_to_serving_s": kills}
    b, a = summary["before"]["ready_median_s"], summary["after"]["ready_median_s"]
    summary["ready_after_over_before"] = round(a / b, 3) if a and b else None
    report["summary"] = summary
    print(write_report(report, args.out), summary, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
