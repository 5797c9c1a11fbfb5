"""Host facts `dloserve serve` needs before and after Ray: who holds a port, which processes
are ours, when one started (psutil; where it cannot see a process the answer says so).
"""

from __future__ import annotations

import errno
import os
import socket
import time
from typing import Any

import psutil


def port_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now by a listener that does not share ports.

    Serve's proxy binds with SO_REUSEPORT, so two proxies can listen on one port and the
    kernel splits the clients between them; a plain bind fails if anyone listens there.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no listener
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def _listening() -> list[Any]:
    """Every listening TCP socket psutil can see (none where it may not look)."""
    try:
        return [c for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
    except psutil.Error:
        return []


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:120] or "?"
    except psutil.Error:
        return "?"


def port_holder(port: int) -> str | None:
    """'pid 123 (ray::ProxyActor)' for a process listening on ``port``, if this user may know."""
    held = [c for c in _listening() if c.laddr.port == port]
    if not held:
        return None
    pid = next((c.pid for c in held if c.pid), None)
    return f"pid {pid} ({_cmdline(pid)})" if pid else "a process this user cannot see"


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...)."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def matching(root: int, needle: str) -> list[int]:
    """Processes below ``root`` whose command line contains ``needle`` ("DPWorker", say)."""
    return [p for p in descendants(root) if needle in _cmdline(p)]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie is dead, only not yet reaped)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def started_at(pid: int) -> float | None:
    """When ``pid`` started (wall clock, the kernel's 10 ms ticks); None when it is gone or a
    zombie. With the pid, it names one process: a pid is reused, a start time with it is not."""
    try:
        p = psutil.Process(pid)
        return None if p.status() == psutil.STATUS_ZOMBIE else p.create_time()
    except psutil.Error:
        return None


def kill_tree(pids: list[int], grace_s: float = 5.0) -> list[int]:
    """SIGTERM, then SIGKILL after ``grace_s`` what is left; returns the pids still alive."""
    for kill, wait in ((psutil.Process.terminate, grace_s), (psutil.Process.kill, 2.0)):
        for pid in pids:
            try:
                kill(psutil.Process(pid))
            except psutil.Error:
                pass
        end = time.monotonic() + wait
        while time.monotonic() < end and (pids := [p for p in pids if alive(p)]):
            time.sleep(0.1)
        if not pids:
            return []
    return pids


def listeners(pids: list[int]) -> list[dict[str, object]]:
    """Every listening TCP socket held by ``pids``: address, port, process, and whether it
    is reachable only from this machine (127.0.0.0/8, ::1, or IPv4-mapped 127.x)."""
    ours = set(pids)
    out = []
    for c in _listening():
        if c.pid not in ours:
            continue
        ip = c.laddr.ip
        try:
            argv0 = (psutil.Process(c.pid).cmdline() or ["?"])[0]
        except psutil.Error:
            argv0 = "?"
        loopback = ip.startswith(("127.", "::ffff:127.")) or ip == "::1"
        out.append({"address": ip, "port": c.laddr.port, "process": os.path.basename(argv0)[:40],
                    "pid": c.pid, "loopback": loopback})
    return sorted(out, key=lambda x: (bool(x["loopback"]), str(x["process"]), str(x["port"]).zfill(5)))
