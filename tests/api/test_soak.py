"""Chaos soak (``make soak``, not in ``make test``): load while ranks and the replica die.

``dloserve serve`` (DP2 AllGather, its own Ray cluster) takes a closed loop of small
requests from three clients for ``SOAK_S`` seconds (150 by default). Meanwhile a rank
process is SIGKILLed every ~20 s and the Serve replica once. Every accepted job must end
``completed`` or ``failed`` with a reason, none may hang or vanish, every completed MP4
must equal the resident output for its request, at least ``SOAK_MIN_COMPLETED`` (0.9) of
the accepted jobs must complete (the jobs a killed group or replica held run again; only
a job that is the suspect of a second death, or on a rank with a collective error, fails),
and when the service is stopped no process of it is left. Besides the counts it reports the
time with no serving group, the group starts tried and failed, and the queue wait of the
completed jobs. The figures go to ``$SOAK_OUT`` (JSON) when set.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from service.api.hostproc import descendants, matching
from service.models.request import GenerationRequest
from tests.api.conftest import Serve
from tests.conftest import free_port

pytestmark = pytest.mark.soak
SOAK_S = float(os.environ.get("SOAK_S", "150"))
SOAK_MIN_COMPLETED = float(os.environ.get("SOAK_MIN_COMPLETED", "0.9"))
VARIANTS = [
    {"prompt": "soak fox", "seed": 1},
    {"prompt": "soak owl", "seed": 2, "num_frames": 9},
    {"prompt": "soak eel", "seed": 3, "width": 48, "guidance_scale": 1.0},
    {"prompt": "soak cat", "seed": 4, "num_inference_steps": 3},
]



def test_chaos_soak(ray_tmp: Path, tmp_path: Path, resident, demo_model: str) -> None:  # noqa: ANN001
    want = {i: hashlib.sha256(resident.generate(GenerationRequest(**v))).hexdigest()
            for i, v in enumerate(VARIANTS)}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # the noise preset, as `want` (the trained default model has other request defaults)
    s = Serve(ray_tmp, demo_model, "--port", str(port), "--data-parallel-size", "2",
              "--enable-distributed-layerwise-offload", "--dlo-mode", "allgather", "--cpus-per-rank", "0.5",
              "--queue-size", "16",
              "--results-dir", str(tmp_path / "results"), "--wave-deadline-base-s", "60",
              "--drain-timeout-s", "30")
    s.watch_until(lambda: "dloserve ready at" in s.output, timeout=300)
    stop = threading.Event()
    lock = threading.Lock()
    jobs: list[dict] = []  # every accepted job and how it ended
    refused = {"n": 0}
    kills = {"rank": 0, "replica": 0}
    retried = {"n": 0}  # content reads tried again (the replica was down)

    def client(cid: int) -> None:
        rng = random.Random(cid)
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                v = rng.randrange(len(VARIANTS))
                try:
                    r = c.post(f"{url}/v1/videos", json=VARIANTS[v])
                except httpx.HTTPError:
                    r = None
                if r is None or r.status_code != 202:  # replica restarting, queue full: not accepted
                    with lock:
                        refused["n"] += 1
                    time.sleep(1.0)
                    continue
                job = {"id": r.json()["id"], "variant": v, "t0": time.monotonic(), "final": None}
                with lock:
                    jobs.append(job)
                end = time.monotonic() + 300
                while time.monotonic() < end:
                    try:
                        got = c.get(f"{url}/v1/videos/{job['id']}")
                        if got.status_code == 200 and got.json()["status"] in ("completed", "failed",
                                                                               "cancelled"):
                            job["final"] = got.json()
                            break
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.2)
                if job["final"] and job["final"]["status"] == "completed":
                    job["sha256"] = fetch(c, job["id"])
                job["seconds"] = time.monotonic() - job["t0"]

    def fetch(c: httpx.Client, vid: str) -> str:
        """The MP4's SHA-256. A read that meets the killed replica (a 5xx from the proxy, a reset)
        is tried again, as any client would; a 4xx, or no 200 within 120 s, is a failure."""
        last: object = None
        end = time.monotonic() + 120
        while time.monotonic() < end:
            try:
                r = c.get(f"{url}/v1/videos/{vid}/content")
                if r.status_code == 200:
                    return hashlib.sha256(r.content).hexdigest()
                last = (r.status_code, r.text[:200])
                if r.status_code < 500:
                    break
            except httpx.HTTPError as e:
                last = repr(e)
            with lock:
                retried["n"] += 1
            time.sleep(0.5)
        return f"unreadable: {last}"

    def chaos() -> None:
        t0 = time.monotonic()
        while not stop.wait(20):
            if not kills["replica"] and time.monotonic() - t0 > 0.6 * SOAK_S:
                for pid in matching(s.proc.pid, "ServeReplica:dloserve"):
                    os.kill(pid, signal.SIGKILL)
                    kills["replica"] += 1
                continue
            ranks = matching(s.proc.pid, "RankActor")
            if ranks:
                os.kill(random.choice(ranks), signal.SIGKILL)
                kills["rank"] += 1

    outage = {"down_s": 0.0, "attempts": {}}  # per replica instance: its group starts

    def monitor() -> None:
        """Time with no serving group, and the group starts each replica made (from /readyz)."""
        last = time.monotonic()
        with httpx.Client(timeout=5) as c:
            while not stop.wait(0.25):
                now = time.monotonic()
                try:
                    r = c.get(f"{url}/readyz").json()
                    serving = r.get("availability") == "serving"
                    outage["attempts"][r["dp_group"]] = r.get("start_attempts", {})
                except (httpx.HTTPError, ValueError, KeyError):
                    serving = False  # the replica itself is down
                if not serving:
                    outage["down_s"] += now - last
                last = now

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    threads.append(threading.Thread(target=chaos))
    threads.append(threading.Thread(target=monitor))
    for t in threads:
        t.start()
    time.sleep(SOAK_S)
    stop.set()
    for t in threads:
        t.join(timeout=400)
    assert not any(t.is_alive() for t in threads), "a client never saw its job end"
    s.seen |= set(descendants(s.proc.pid))
    assert s.stop(signal.SIGTERM, timeout=180) == 0, s.output[-3000:]
    lost = [j for j in jobs if j["final"] is None]
    failed = [j for j in jobs if j["final"] and j["final"]["status"] == "failed"]
    done = [j for j in jobs if j["final"] and j["final"]["status"] == "completed"]
    wrong = [j for j in done if j["sha256"] != want[j["variant"]]]
    figures = {"seconds": SOAK_S, "accepted": len(jobs), "completed": len(done), "failed": len(failed),
               "lost": len(lost), "wrong_bytes": len(wrong), "refused_while_down": refused["n"],
               "unreadable": sorted(j["sha256"] for j in wrong if j["sha256"].startswith("unreadable")),
               "content_reads_retried": retried["n"],
               "rank_kills": kills["rank"], "replica_kills": kills["replica"],
               "failure_reasons": sorted({j["final"]["error"]["message"][:80] for j in failed}),
               "max_job_seconds": round(max((j["seconds"] for j in jobs), default=0), 1),
               "completed_share": round(len(done) / max(1, len(jobs)), 3),
               "no_serving_group_s": round(outage["down_s"], 1),
               "group_starts_ready": sum(a.get("ready", 0) for a in outage["attempts"].values()),
               "group_starts_failed": sum(a.get("failed", 0) for a in outage["attempts"].values()),
               "queue_wait_s": _spread([j["final"]["timings"]["queue_s"] for j in done
                                        if (j["final"].get("timings") or {}).get("queue_s") is not None]),
               "survivors": s.survivors()}
    print(json.dumps(figures, indent=1))
    if os.environ.get("SOAK_OUT"):
        out = Path(os.environ["SOAK_OUT"])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(figures, indent=1))
    assert not lost and not wrong, figures
    assert all(j["final"]["error"] and j["final"]["error"]["message"] for j in failed), figures
    # A kill every 20 s, the replica's once past 60% of the run: a short SOAK_S has fewer.
    assert kills["rank"] >= max(1, int(SOAK_S // 20) - 3) and kills["replica"] == 1, figures
    assert len(done) >= 10 and figures["completed_share"] >= SOAK_MIN_COMPLETED, figures
    assert not figures["survivors"], figures


def _spread(values: list[float]) -> dict[str, float]:
    """Median, 90th percentile and max."""
    if not values:
        return {}
    v = sorted(values)
    return {"p50": round(v[len(v) // 2], 3), "p90": round(v[int(len(v) * 0.9)], 3), "max": round(v[-1], 3)}
