"""`dloserve serve` SIGKILLed with a job running and one queued, then started again on the same
results folder (its own Ray cluster each time; the watchdog takes the first one down): both
jobs show ``queued`` at once, then complete; the one that was running goes on from its saved
step (``resumed_from_step`` >= 1), and its MP4 equals the same request's run without a
restart. The model is the "tiny" demo preset, named: Wan's UniPC scheduler, whose history
between steps the saved state holds (models/loop.py).

The first start also is the watchdog's end-to-end check (service/api/watchdog.py; its unit
test is tests/api/test_watchdog.py): it runs with ``--ray-dashboard``, so Ray's whole
dashboard and its module processes are there too, and nothing of it outlives the SIGKILL
(before the watchdog, two Ray agents of the old cluster stayed alive).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import Serve, wait_final
from tests.conftest import free_port

pytestmark = pytest.mark.e2e  # two `dloserve serve` start-ups and a 100-step job


def record(folder: Path, vid: str) -> dict:
    try:
        return json.loads((folder / f"{vid}.json").read_text())
    except (OSError, ValueError):
        return {}


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_a_restart_on_the_same_folder_finishes_every_job_from_its_step(ray_tmp: Path, tmp_path: Path) -> None:
    from service.models.demo import ensure_demo_model

    fresh = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))  # short: Ray's socket paths
    try:
        run(str(ensure_demo_model("tiny")), ray_tmp, fresh, tmp_path)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)


def run(model: str, ray_tmp: Path, fresh: Path, tmp_path: Path) -> None:
    folder, port = tmp_path / "results", str(free_port())
    args = (model, "--port", port, "--results-url", str(folder), "--cpus-per-rank", "1",
            "--encoders-per-rank", "0")
    url = f"http://127.0.0.1:{port}"
    body = {"prompt": "a job that outlives its server", "seed": 41, "num_inference_steps": 100}
    first = Serve(ray_tmp, *args, "--ray-dashboard")
    first.watch_until(lambda: "dloserve ready at" in first.output, timeout=300)
    assert len(first.seen) > 3, first.seen  # Ray's processes, the replica, the ranks
    cmds = [Path(f"/proc/{p}/cmdline").read_bytes() for p in first.seen if Path(f"/proc/{p}").exists()]
    dashboards = [c for c in cmds if b"ray/dashboard/dashboard.py" in c]  # the whole one: a web server
    assert dashboards and not [c for c in dashboards if b"--disable-frontend" in c], dashboards
    running = httpx.post(f"{url}/v1/videos", json=body, timeout=30).json()["id"]
    queued = httpx.post(f"{url}/v1/videos", json={**body, "seed": 42, "num_inference_steps": 4},
                        timeout=30).json()["id"]
    first.watch_until(lambda: (folder / f"{running}.state").exists()
                      and record(folder, running).get("status") == "in_progress", timeout=300)
    assert record(folder, queued).get("status") == "queued"
    # The rank frozen first: the watchdog stops the cluster a second or three after the kill,
    # and a fast host finished the job in that time (40 steps of the tiny model, 2026-12-03).
    ranks = [p for p in first.seen if b"RankActor" in _cmdline(p)]
    assert ranks, first.seen
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    first.stop(signal.SIGKILL, timeout=30)
    end = time.monotonic() + 120
    while first.survivors():  # the watchdog takes its cluster down, the dashboard's processes too
        assert time.monotonic() < end, first.survivors()
        time.sleep(0.5)
    # unfinished, as the kill left it: in_progress, or queued where the watchdog's SIGTERMs let
    # its replica see the rank die first; never failed "service stopped" (VideoService.close)
    assert record(folder, running)["status"] in ("in_progress", "queued"), record(folder, running)
    assert record(folder, queued)["status"] == "queued"

    second = Serve(fresh, *args)  # a Ray temp folder of its own: nothing of the killed cluster's
    second.watch_until(lambda: record(folder, running).get("status") != "in_progress", timeout=300)
    assert record(folder, running)["status"] == "queued"  # at once: not shown running with nothing on it
    second.watch_until(lambda: "dloserve ready at" in second.output, timeout=300)
    done = {vid: wait_final(url, vid, timeout=600) for vid in (running, queued)}
    assert all(v["status"] == "completed" for v in done.values()), done
    assert done[running]["resumed_from_step"] >= 1, done[running]
    assert done[queued]["resumed_from_step"] == 0
    control = httpx.post(f"{url}/v1/videos", json=body, timeout=30).json()["id"]
    assert wait_final(url, control, timeout=600)["status"] == "completed"
    resumed = httpx.get(f"{url}/v1/videos/{running}/content", timeout=30).content
    assert resumed == httpx.get(f"{url}/v1/videos/{control}/content", timeout=30).content
    assert not list(folder.glob("*.req")) and not list(folder.glob("*.state"))
    assert second.stop(signal.SIGTERM) == 0
