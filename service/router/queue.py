"""What every scheduler queues: a ``Ticket`` per request, where a ticket queued again goes
(``place``), and ``QueueFull``, the bounded queue's refusal (429 with Retry-After). Shared by
the continuous and the waves policy, the dispatcher and the front ends."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any


class QueueFull(Exception):
    """The bounded queue is full; the caller should answer 429 with ``retry_after_s``."""

    def __init__(self, depth: int, retry_after_s: int) -> None:
        super().__init__(f"queue full ({depth} waiting); retry after {retry_after_s}s")
        self.depth = depth
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[type, tuple[int, int]]:
        return type(self), (self.depth, self.retry_after_s)


@dataclass
class Ticket:
    """One queued request: its id, compatibility key, payload and arrival time."""

    id: str
    key: str
    payload: Any
    enqueued_at: float
    cost: float = 1.0  # relative time of one forward (continuous scheduling weighs it)
    tenant: str | None = None  # the API key's owner id (tenants.py shares ranks between them)
    reruns: int = 0  # times it was queued again as the suspect of a death (bounded by job_retries)
    requeues: int = 0  # times it was queued again, for any cause (it then goes ahead of later arrivals)
    priority: int = 0  # lower is served first (router/priority.py)
    preemptions: int = 0  # times it was paused for a better-priority request (bounded)
    requeued_for: str = ""  # why it was last queued again: preempted, rerun, adopted (resumes' cause)


def place(q: deque[Ticket], t: Ticket) -> int:
    """Where a ticket queued again goes: after those that came earlier (or at the same time
    and were queued again too), before the rest."""
    for i, x in enumerate(q):
        if x.enqueued_at > t.enqueued_at or (x.enqueued_at == t.enqueued_at and not x.requeues):
            return i
    return len(q)
