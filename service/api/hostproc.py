"""Host facts `dloserve serve` needs before and after Ray: who holds a port, which processes
are ours. Linux /proc only; elsewhere the answers are "unknown" and nothing is killed.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import time
from pathlib import Path


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


def port_holder(port: int) -> str | None:
    """'pid 123 (ray::ProxyActor)' for a process listening on ``port``, if /proc tells."""
    inodes = {inode for _, p, inode in _listening() if p == port}
    if not inodes:
        return None
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            for fd in (pid_dir / "fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return f"pid {pid_dir.name} ({_cmdline(pid_dir)})"
        except OSError:
            continue
    return "a process this user cannot see"


def _listening() -> list[tuple[str, int, str]]:
    """(address, port, socket inode) of every listening TCP socket (/proc/net/tcp{,6})."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A":  # LISTEN
                hexip, hexport = f[1].split(":")
                out.append((_ip(hexip), int(hexport, 16), f[9]))
    return out


def _cmdline(pid_dir: Path) -> str:
    try:
        cmd = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"
    return cmd[:120] or "?"


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def matching(root: int, needle: str) -> list[int]:
    """Processes below ``root`` whose command line contains ``needle`` ("DPWorker", say)."""
    out = []
    for pid in descendants(root):
        try:
            if needle in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                out.append(pid)
        except OSError:
            continue
    return out


def kill_tree(pids: list[int], grace_s: float = 5.0) -> list[int]:
    """SIGTERM, then SIGKILL after ``grace_s`` what is left; returns the pids still alive."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + wait
        while time.monotonic() < end and (pids := [p for p in pids if _alive(p)]):
            time.sleep(0.1)
        if not pids:
            return []
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie is dead, only not yet reaped


def listeners(pids: list[int]) -> list[dict[str, object]]:
    """Every listening TCP socket held by ``pids``: address, port, process, and whether it
    is reachable only from this machine (127.0.0.0/8, ::1, or IPv4-mapped 127.x)."""
    owner: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    owner[link[8:-1]] = pid
        except OSError:
            continue
    out = []
    for ip, port, inode in _listening():
        if inode not in owner:
            continue
        try:
            argv0 = Path(f"/proc/{owner[inode]}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            argv0 = b"?"
        loopback = ip.startswith(("127.", "::ffff:127.")) or ip == "::1"
        name = os.path.basename(argv0.decode(errors="replace"))[:40]
        out.append({"address": ip, "port": port, "process": name, "pid": owner[inode], "loopback": loopback})
    return sorted(out, key=lambda x: (bool(x["loopback"]), str(x["process"]), str(x["port"]).zfill(5)))


def _ip(h: str) -> str:
    """An address as /proc/net/tcp{,6} writes it (little-endian 32-bit words, hex)."""
    if len(h) == 8:
        return socket.inet_ntop(socket.AF_INET, bytes.fromhex(h)[::-1])
    raw = b"".join(bytes.fromhex(h[i:i + 8])[::-1] for i in range(0, 32, 8))
    return socket.inet_ntop(socket.AF_INET6, raw)
