"""Start-up benchmark: `dloserve serve` from the command to ready, with /readyz's breakdown,
a restart, and a rank SIGKILLed mid-request (kill -> serving again, the request's completion).

    python loadtest/bench_startup.py --model /tmp/wan12 --starts kill,kill-nostandby \\
        --label 12-bf16 --out $OUT/h200-startup-12.json

Each start runs ``dloserve serve MODEL --enable-distributed-layerwise-offload`` (plus
``--serve-args``), polls ``/readyz`` until 200 and records the seconds from the command and
``/readyz``'s ``startup`` (the command to ready, step by step) and the groups' ``last_start``.
The starts run one after another on one model, so the second is a restart (page cache, Ray's
and torch's caches as the first left them). A start is one of:

- ``ready``: ready, then stop;
- ``kill`` (``--rank-standby``) / ``kill-nostandby`` (``--no-rank-standby``): once ready, one
  request runs undisturbed (its own time), the standbys settle (imported, and loaded ahead
  where they do: ``standby_wait_s`` after that request), the same request runs again and one
  rank process is SIGKILLed once it has made ``--kill-at`` percent progress; recorded: the kill to
  ``/readyz`` 200 with every group on a new generation (serving again), the killed request's
  final status, the step its rerun went on from (``resumed_from_step``: 0 reran it from the
  start) and its submit-to-final time against its own, and a request sent after.

``--euler`` serves a view of ``--model`` with a flow-matching Euler scheduler instead of its
own (the demo models have Wan2.1's UniPC); either way the killed request's rerun goes on from
its last step (models/resume.py), with Euler's smaller state (models/loop.py).

CPU smoke run: ``--device cpu --model /tmp/tiny`` (``dloserve demo-model /tmp/tiny``).
The kill to the resumed request's end on one H200 (``/tmp/wan12``: ``dloserve demo-model
/tmp/wan12 --preset wan14b-shape --layers 12``):

    python loadtest/bench_startup.py --model /tmp/wan12 --euler --starts kill --size 832x480x81 \
        --steps 8 --kill-at 50 --label 12-bf16-resume --out $OUT/h200-resume-kill.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from reporting import header, write_report
from serving import FINAL, final, pids_matching, stop_serve

from service.engine.ports import free_port

KINDS = ("ready", "kill", "kill-nostandby")


def readyz(url: str) -> tuple[int, dict[str, Any]]:
    try:
        r = httpx.get(f"{url}/readyz", timeout=5)
        return r.status_code, r.json()
    except (httpx.HTTPError, ValueError):
        return 0, {}


def wait_ready(url: str, proc: subprocess.Popen, timeout: float,
               after_gen: dict[str, int] | None = None) -> float:
    """Seconds until /readyz is 200 (and, with ``after_gen``, every group past that generation)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited (rc {proc.returncode}) before it was ready: see its log")
        code, body = readyz(url)
        if code == 200 and (after_gen is None or all(
                g.get("generation", 0) > after_gen.get(g.get("group"), -1) and g.get("state") == "ready"
                for g in body.get("groups", []))):
            return time.monotonic() - t0
        time.sleep(0.1)
    raise TimeoutError(f"not ready after {timeout} s")


def request(url: str, body: dict[str, Any]) -> tuple[str, float]:
    """Send ``body``; returns its id and a clock started at the send."""
    t = time.monotonic()
    return httpx.post(f"{url}/v1/videos", json=body, timeout=60).json()["id"], t


def kill_run(url: str, proc: subprocess.Popen, body: dict[str, Any], timeout: float,
             kill_at: int = 10) -> dict[str, Any]:
    """One request undisturbed, then the same again with a rank SIGKILLed at >= ``kill_at`` %
    progress, once the service keeps a step of it (``resumable_step``: progress alone does not
    say that a rerun would go on from a step, the kept state comes after its step)."""
    out: dict[str, Any] = {}
    vid, t = request(url, body)
    own = final(url, vid, timeout, poll_s=0.1)
    out["own_request"] = {"status": own["status"], "s": round(time.monotonic() - t, 2),
                          "timings": own.get("timings")}
    out["standby_wait_s"], out["standbys_loaded"] = standbys_settled(url, timeout)
    _, before = readyz(url)
    gens = {g["group"]: g.get("generation", 0) for g in before.get("groups", [])}
    vid, t_sent = request(url, {**body, "prompt": "killed mid-request"})
    while ((v := httpx.get(f"{url}/v1/videos/{vid}", timeout=30).json())["progress"] < kill_at
           or v.get("resumable_step", 0) < 1):
        if v["status"] in FINAL:
            raise RuntimeError(f"the request to kill ended ({v['status']}) before it showed progress")
        time.sleep(0.05)
    ranks = pids_matching(proc.pid, "RankActor")  # never a standby (its class is StandbyRank)
    out["rank_processes"] = len(ranks)
    t_kill = time.monotonic()
    os.kill(ranks[-1], signal.SIGKILL)
    out["kill_at_progress"], out["kill_at_resumable_step"] = v["progress"], v.get("resumable_step")
    out["kill_to_serving_s"] = round(wait_ready(url, proc, timeout, gens), 2)
    killed = final(url, vid, timeout, poll_s=0.1)
    t_done = time.monotonic()
    out["killed_request"] = {
        "status": killed["status"], "reason": (killed.get("error") or {}).get("message"),
        "resumed_from_step": killed.get("resumed_from_step"), "kill_at_s": round(t_kill - t_sent, 2),
        "kill_to_final_s": round(t_done - t_kill, 2), "sent_to_final_s": round(t_done - t_sent, 2),
        "over_own_s": round(t_done - t_sent - out["own_request"]["s"], 2), "timings": killed.get("timings")}
    vid, t = request(url, {**body, "prompt": "after", "num_inference_steps": 2})
    nxt = final(url, vid, timeout, poll_s=0.1)
    out["next_request"] = {"status": nxt["status"], "s": round(time.monotonic() - t, 2)}
    _, after = readyz(url)
    out["rebuild"] = [g.get("last_start") for g in after.get("groups", [])]
    out["standbys"] = after.get("standbys")
    return out


def standbys_settled(url: str, timeout: float) -> tuple[float, dict[str, Any]]:
    """Seconds until every group's standby has imported and, where it does, loaded ahead
    (``/readyz`` ``standbys_loaded``: None while loading): a rank dies at any time, most often
    long after its group started, so the kill is timed against a standby that is ready."""
    t0 = time.monotonic()
    loaded: dict[str, Any] = {}
    while time.monotonic() - t0 < timeout:
        loaded = readyz(url)[1].get("standbys_loaded") or {}
        if loaded and all(v is not None for v in loaded.values()):
            break
        time.sleep(0.5)
    return round(time.monotonic() - t0, 2), loaded


def one_start(args: argparse.Namespace, kind: str, logdir: Path, n: int) -> dict[str, Any]:
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    serve = ([shutil.which("dloserve")] if shutil.which("dloserve") and not args.module
             else [sys.executable, "-m", "service.cli"])
    cmd = [*serve, "serve", args.served, "--enable-distributed-layerwise-offload", "--port", str(port),
           *shlex.split(args.serve_args)]
    if args.device == "cpu":
        cmd += ["--gpus-per-rank", "0", "--cpus-per-rank", "0.5"]
    if kind != "ready":  # said outright (the default is on with GPU ranks, off on CPU ones)
        cmd += ["--rank-standby" if kind == "kill" else "--no-rank-standby"]
    log_path = logdir / f"{args.label}-start{n}-{kind}.log"
    res: dict[str, Any] = {"kind": kind, "command": shlex.join(cmd), "log": log_path.name}
    with open(log_path, "w") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
        try:
            wait_ready(url, proc, args.timeout)
            res["command_to_ready_s"] = round(time.monotonic() - t0, 2)  # from before the exec
            _, body = readyz(url)
            res["startup"] = body.get("startup")
            res["last_start"] = [g.get("last_start") for g in body.get("groups", [])]
            res["offload_mode"] = body.get("offload_mode")
            if kind != "ready":
                w, h, f = (int(x) for x in args.size.split("x"))
                req = {"prompt": "own time", "seed": 1, "width": w, "height": h, "num_frames": f,
                       "num_inference_steps": args.steps}
                res.update(kill_run(url, proc, req, args.timeout, args.kill_at))
        except Exception as e:  # noqa: BLE001 - recorded, the next start still runs
            res["error"] = f"{type(e).__name__}: {e}"
        finally:
            t_stop = time.monotonic()
            stop_serve(proc, log, 60)
            res["stop_s"] = round(time.monotonic() - t_stop, 1)
    return res


def summary(s: dict[str, Any]) -> dict[str, Any]:
    st = s.get("startup") or {}
    out = {k: s.get(k) for k in ("kind", "command_to_ready_s", "kill_to_serving_s", "error") if s.get(k)}
    out.update(steps=st.get("steps"), unaccounted_s=st.get("unaccounted_s"), parallel=st.get("parallel"))
    out["offload_mode"] = {k: (s.get("offload_mode") or {}).get(k) for k in ("mode", "source")}
    if "killed_request" in s:
        out["killed"] = {k: s["killed_request"][k] for k in ("status", "resumed_from_step", "kill_to_final_s",
                                                              "sent_to_final_s", "over_own_s")}
        out["own_s"] = s["own_request"]["s"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--label", default="run", help="names the logs and the JSON's runs (12-bf16, say)")
    p.add_argument("--starts", default="kill,kill-nostandby",
                   help=f"comma-separated, one after another: {', '.join(KINDS)}")
    p.add_argument("--serve-args", default="", help="more serve flags (--quantization fp8, say)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--size", default="832x480x33", help="WIDTHxHEIGHTxFRAMES of the requests")
    p.add_argument("--steps", type=int, default=10, help="steps of the timed and the killed request")
    p.add_argument("--kill-at", type=int, default=10, help="the killed request's progress (%%) at the kill")
    p.add_argument("--euler", action="store_true",
                   help="serve MODEL with a flow-matching Euler scheduler instead of its own")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--port", type=int, default=0, help="a running Serve's port (0: a free one)")
    p.add_argument("--module", action="store_true", help="python -m service.cli even if dloserve is on PATH")
    p.add_argument("--out", required=True, help="JSON file (appended to: one entry per call)")
    args = p.parse_args()
    kinds = args.starts.split(",")
    if bad := [k for k in kinds if k not in KINDS]:
        p.error(f"--starts: {bad} not in {KINDS}")
    out = Path(args.out)
    doc: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"runs": []}
    run: dict[str, Any] = {"label": args.label, **header(args.device), "model": args.model, "starts": [],
                           "env": {k: v for k, v in os.environ.items() if k.startswith("DLOSERVE_")}}
    doc["runs"].append(run)
    with tempfile.TemporaryDirectory() as tmp:
        args.served = args.model
        if args.euler:
            from service.models.demo.euler import euler_view

            args.served = str(euler_view(args.model, Path(tmp) / "euler"))
            run["scheduler"] = "FlowMatchEulerDiscreteScheduler"
        for n, kind in enumerate(kinds):
            run["starts"].append(one_start(args, kind, out.parent, n))
            write_report(doc, out)  # each start kept even if a later one hangs
            print(json.dumps({"label": args.label, "start": n, **summary(run["starts"][-1])}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
