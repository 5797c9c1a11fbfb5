"""Warm hosts (engine.warmhost): rank processes that start and import before Ray is up.

- a pre-started rank whose worker command is the shim runs in the host's process (the
  same pid: no new interpreter), with the host's imports counted and Ray's environment of
  the worker in place (it joins the job and passes the cluster's token check);
- it ends with its actor, and the shim with it;
- a shim that finds no host runs the plain worker: the rank still starts, in a new process;
- a host whose launcher dies ends too (it would wait for a worker forever).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import ray

from service.config import EngineConfig, OffloadConfig, OffloadMode, ParallelConfig
from service.engine.warmhost import WarmHosts

ROOT = Path(__file__).resolve().parents[2]


def gone(pid: int) -> bool:
    """Ended (a zombie that no one reaped counts: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.2)
    return False


def test_a_host_ends_with_its_launcher() -> None:
    code = ("import os; from service.engine.warmhost import WarmHosts; h = WarmHosts(1, None, 1); "
            "print(h.pids()[0], h.folder, flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True).stdout
    pid, folder = out.split()
    try:
        assert wait_gone(int(pid), timeout=60), f"warm host {pid} outlived its launcher"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_the_ingress_host_imports_the_apps_imports_but_not_ray() -> None:
    """The Serve replica's host imports what service.api.app imports (torch, FastAPI, the
    service) while Ray starts; Ray itself, and whatever imports it, is left to the worker
    (Ray's C++ side reads the worker's environment once, at its import)."""
    from service.engine.warmhost import imports_of

    names = imports_of("service.api.app")
    assert "ray" in names and "fastapi" in names and "service.api.service" in names, names
    code = ("import json, sys; from service.engine.warmhost import import_imports_of; "
            "done = import_imports_of('service.api.app'); "
            "print(json.dumps({'done': done, 'modules': sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('ray', 'torch', 'fastapi'))}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True).stdout
    facts = json.loads(out.splitlines()[-1])
    assert not any(m == "ray" or m.startswith("ray.") for m in facts["modules"]), facts["modules"]
    assert "torch" in facts["modules"] and "fastapi" in facts["modules"]
    assert "service.api.service" in facts["done"] and "ray" not in facts["done"], facts["done"]


@pytest.mark.e2e  # each host imports torch and diffusers; each rank builds the model's classes
def test_a_pre_started_rank_runs_in_its_warm_host(ray_cluster: dict, demo_model: str) -> None:
    from service.engine.place import NAMESPACE
    from service.engine.standby import prestart

    spec = EngineConfig(demo_model, offload=OffloadConfig(OffloadMode.RANK_LOCAL),
                        parallel=ParallelConfig(dp_size=2, cpus_per_rank=0.5, rank_standby=False,
                                                encoders_per_rank=0, rank_standby_preload=False))
    hosts = WarmHosts(2, demo_model, 1)
    try:
        hosts.procs[1].kill()  # no host answers process 1's shim: it runs the plain worker
        hosts.procs[1].wait(timeout=30)
        held = prestart(spec, uuid.uuid4().hex[:8], NAMESPACE, hosts)
        actors = list(held.values())
        first, second = ray.get([a.started.remote() for a in actors], timeout=400)
        assert first["pid"] == hosts.pids()[0] and first["hosted"] is True, first
        assert hosts.started_at <= first["created"] < first["imported_at"]  # the host's start
        assert ray.get(actors[0].ping.remote(), timeout=60) == hosts.pids()[0]
        assert second["pid"] != hosts.pids()[1] and second["hosted"] is False, second
        ray.kill(actors[0])
        assert wait_gone(hosts.pids()[0], timeout=60), "the host outlived its killed actor"
        ray.kill(actors[1])
    finally:
        hosts.close()


def test_the_folders_of_a_killed_launcher_are_swept_at_the_next_start(tmp_path: Path) -> None:
    """A SIGKILLed ``serve`` leaves its hosts' folder; the next WarmHosts removes the folders
    whose launcher (a real process, killed) is gone, and none of a live one's."""
    import signal

    from service.engine.warmhost import FOLDER_PREFIX, OWNER, sweep_stale

    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead, live, unnamed = (tmp_path / f"{FOLDER_PREFIX}{n}" for n in ("dead", "live", "old"))
    for folder, pid in ((dead, launcher.pid), (live, os.getpid()), (unnamed, None)):
        folder.mkdir(mode=0o700)
        (folder / "rank0.log").write_text("a host's log")
        if pid is not None:
            (folder / OWNER).write_text(str(pid))
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    assert sweep_stale(str(tmp_path)) == 1
    assert not dead.exists() and live.exists() and unnamed.exists()
    hosts = WarmHosts(0, None, 1)  # a start names its launcher in its folder, for the next one's sweep
    try:
        assert (Path(hosts.folder) / OWNER).read_text() == str(os.getpid())
    finally:
        hosts.close()
