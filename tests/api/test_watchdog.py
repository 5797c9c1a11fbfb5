"""The watchdog (service/api/watchdog.py): a SIGKILL of its process leaves nothing of it behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from service.api.hostproc import started_at

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
        while started_at(agent) is not None:
            assert time.monotonic() < end, "the agent outlived its parent's SIGKILL"
            time.sleep(0.1)
    finally:
        if parent.poll() is None:
            parent.kill()
        if agent and started_at(agent) is not None:
            os.kill(agent, signal.SIGKILL)


# A real `dloserve serve --ray-dashboard` SIGKILLed, every process of it gone: the first start
# of tests/api/test_restart_e2e.py (make e2e), which kills one with a job running anyway.
