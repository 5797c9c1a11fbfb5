"""``python -m service.api.watchdog PID``: once ``dloserve serve`` (PID) is gone, however it
went (a SIGKILL leaves it no time to stop anything), stop every process it had below it.

Ray's processes do not all share their starter's fate: after a SIGKILL of ``serve`` its
agents stayed alive, re-parented to init. The watchdog runs beside ``serve`` (its own
session, so a Ctrl-C to the terminal's group reaches ``serve`` only), notes every process
below it each second, and once PID has died sends each one still alive (the same process:
its start time is checked, not only its pid) SIGTERM, then SIGKILL. A normal stop of
``serve`` ends the watchdog with the rest of its processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from service.api.hostproc import descendants, kill_tree, started_at


def watch(pid: int, every_s: float = 1.0, grace_s: float = 2.0) -> list[int]:
    """Until ``pid`` dies; then stop what was below it. Returns the pids it stopped."""
    born = started_at(pid)
    ours: dict[int, float] = {}
    first = True
    while born is not None and started_at(pid) == born:
        for p in descendants(pid):
            if p != os.getpid() and p not in ours and (t := started_at(p)) is not None:
                ours[p] = t
        if first:
            print(f"dloserve watchdog: watching pid {pid}", file=sys.stderr, flush=True)
            first = False
        time.sleep(every_s)
    left = [p for p, t in ours.items() if started_at(p) == t]
    kill_tree(left, grace_s)
    return left


def start_watchdog() -> subprocess.Popen[bytes]:
    """The watchdog of this process. Its environment is passed as a copy: without one the child
    execs with the process's own ``environ``, which another thread's setenv may move meanwhile
    (the launcher's imports beside Ray's start do: numpy's, Ray's), and the exec then fails with
    EFAULT, "Bad address" (once in CI; tests/api/test_watchdog.py causes it on purpose)."""
    return subprocess.Popen([sys.executable, "-m", "service.api.watchdog", str(os.getpid())],
                            stdin=subprocess.DEVNULL, start_new_session=True, env=dict(os.environ))


if __name__ == "__main__":
    watch(int(sys.argv[1]))
