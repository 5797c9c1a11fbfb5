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


# Another thread changing the C environment (as numpy's and Ray's imports do beside the
# launcher's start of Ray) while the watchdog is started, many times over.
CHURN = """
import os, threading
from service.api.watchdog import start_watchdog
stop = False
def churn():
    i = 0
    while not stop:
        os.putenv(f"CHURN_{i % 50}", "x"); os.unsetenv(f"CHURN_{i % 50}"); i += 1
threading.Thread(target=churn, daemon=True).start()
failed = 0
for _ in range(40):
    try:
        dog = start_watchdog()
    except OSError as e:
        failed += 1
        print(e)
        continue
    dog.kill(); dog.wait()
stop = True
print("failed", failed)
"""


def test_the_watchdog_starts_while_another_thread_changes_the_environment() -> None:
    """Without its own copy of the environment the exec read the process's ``environ`` while the
    other thread moved it: "[Errno 14] Bad address" in about one start of three here."""
    r = subprocess.run([sys.executable, "-c", CHURN], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "failed 0", r.stdout[-2000:]
