"""A free TCP port for a group's rendezvous (torch-free: the executors, tests and benchmarks)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """An ephemeral port of ``host`` that was free a moment ago (a rendezvous binds it next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
