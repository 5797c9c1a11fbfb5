"""The watchdog (service/api/watchdog.py): a SIGKILL of its process leaves nothing of it behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from service.api.watchdog import start_time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# As `dloserve serve` and Ray: a child in a session of its own (re-parented to init once
# its parent dies, as Ray's agents were), then the watchdog.
PARENT = """
import subprocess, sys, time
from service.api.watchdog import start_watchdog
agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(agent.pid, flush=True)
start_watchdog()
time.sleep(600)
"""


def test_a_sigkilled_parents_processes_are_stopped_by_its_watchdog() -> None:
    env = {**os.environ, "PYTHONPATH": ROOT}
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    agent = 0
    try:
        assert parent.stdout is not None and parent.stderr is not None
        agent = int(parent.stdout.readline())
        assert "watching pid" in parent.stderr.readline()  # its first look below the parent is done
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        end = time.monotonic() + 60  # a bound on the wait, not a measurement
        while start_time(agent) is not None:
            assert time.monotonic() < end, "the agent outlived its parent's SIGKILL"
            time.sleep(0.1)
    finally:
        if parent.poll() is None:
            parent.kill()
        if agent and start_time(agent) is not None:
            os.kill(agent, signal.SIGKILL)


@pytest.mark.e2e  # a `dloserve serve` subprocess and its own Ray cluster
def test_nothing_of_a_sigkilled_serve_outlives_it(ray_tmp: Path) -> None:
    """Before the watchdog, two Ray agents of the old cluster stayed alive. With
    ``--ray-dashboard`` (off by default) Ray's dashboard and its module processes are there too."""
    from tests.api.conftest import Serve
    from tests.conftest import free_port

    s = Serve(ray_tmp, "--host", "127.0.0.1", "--port", str(free_port()), "--drain-timeout-s", "5",
              "--ray-dashboard")
    s.watch_until(lambda: "dloserve ready at" in s.output, timeout=300)
    assert len(s.seen) > 3, s.seen  # Ray's processes, the replica, the ranks
    cmds = [Path(f"/proc/{p}/cmdline").read_bytes() for p in s.seen if Path(f"/proc/{p}").exists()]
    dashboards = [c for c in cmds if b"ray/dashboard/dashboard.py" in c]  # the whole one: a web server
    assert dashboards and not [c for c in dashboards if b"--disable-frontend" in c], dashboards
    s.proc.send_signal(signal.SIGKILL)
    s.proc.wait(10)
    end = time.monotonic() + 60  # a bound on the wait, not a measurement
    while s.survivors():
        assert time.monotonic() < end, s.survivors()
        time.sleep(0.2)
