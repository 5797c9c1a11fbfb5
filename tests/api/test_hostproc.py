"""The launcher's host facts (service.api.hostproc) on real sockets and processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from service.api.hostproc import (
    alive,
    descendants,
    kill_tree,
    listeners,
    matching,
    port_free,
    port_holder,
    started_at,
)


def test_a_listening_port_is_taken_and_its_holder_named() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.listen()
        assert not port_free("127.0.0.1", port)
        assert (port_holder(port) or "").startswith(f"pid {os.getpid()} (")
        mine = [x for x in listeners([os.getpid()]) if x["port"] == port]
        assert [(x["address"], x["pid"], x["loopback"]) for x in mine] == [("127.0.0.1", os.getpid(), True)]
        assert listeners([os.getpid() + 10**6]) == []
    assert port_holder(port) is None


def test_a_tree_is_found_and_stopped_even_where_sigterm_is_ignored() -> None:
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)  # grandchild']); "
            "time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        end = time.monotonic() + 10
        while not descendants(child.pid) and time.monotonic() < end:  # the grandchild started
            time.sleep(0.05)
        below = descendants(child.pid)
        assert len(below) == 1 and matching(os.getpid(), "# grandchild") == below
        born = started_at(child.pid)
        assert born is not None and born == started_at(child.pid)  # the same process, the same answer
        # the grandchild goes on SIGTERM, the child (SIGTERM ignored) on SIGKILL
        assert kill_tree([child.pid, *below], grace_s=0.5) == []
        assert not alive(child.pid)  # a zombie until reaped: dead all the same
        assert started_at(child.pid) is None
    finally:
        child.kill()
        child.wait()
