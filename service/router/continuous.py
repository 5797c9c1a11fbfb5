"""One FIFO queue and the rule that picks the request a freed rank starts next.

Pure Python with an injectable clock, like waves.py. In an AllGather group every tick
lasts as long as the slowest rank's forward, so what a freed rank takes matters to the
others: a request whose forward costs no more than the slowest one already running rides
for free; a costlier one slows every rank down for as long as it runs. The rule:

1. A request that has waited ``starve_s`` or more goes first (oldest first): nothing waits
   forever behind a stream of better-fitting requests.
2. With nothing running on the other ranks, the oldest request goes.
3. Otherwise the costliest request that fits under the slowest running forward goes (the
   most work done for free); if none fits, the cheapest one (the least slowdown).
Ties go to the older request. A rank that makes no collectives has no "others": it takes
the oldest request (rule 2). With ``priority`` given, only requests of that priority are
considered (the scheduler asks for the best one queued: router/priority.py).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from service.config.scheduler import SchedulerConfig
from service.router.queue import QueueFull, Ticket, place


@dataclass
class ContinuousQueue:
    """A bounded queue of tickets for continuous (forward-level) scheduling."""

    max_queue: int = SchedulerConfig.queue_size
    starve_s: float = SchedulerConfig.starve_s
    _q: deque[Ticket] = field(default_factory=deque)
    _ids: set[str] = field(default_factory=set)
    _latency_s: float = 0.0  # moving average of request latency, for Retry-After

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ValueError("max_queue must be >= 1")

    @property
    def depth(self) -> int:
        return len(self._q)

    def submit(self, ticket_id: str, key: str, payload: Any, cost: float = 1.0,
               now: float | None = None, tenant: str | None = None) -> Ticket:
        if ticket_id in self._ids:
            raise ValueError(f"duplicate ticket id {ticket_id}")
        if len(self._q) >= self.max_queue:
            raise QueueFull(len(self._q), self.retry_after_s())
        t = Ticket(ticket_id, key, payload, time.monotonic() if now is None else now, cost, tenant)
        self._q.append(t)
        self._ids.add(ticket_id)
        return t

    def tickets(self) -> list[Ticket]:
        """The queue, oldest first (not removed)."""
        return list(self._q)

    def cancel(self, ticket_id: str) -> bool:
        if ticket_id not in self._ids:
            return False
        self._ids.discard(ticket_id)
        self._q = deque(t for t in self._q if t.id != ticket_id)
        return True

    def put_back(self, t: Ticket) -> None:
        """Queue a ticket again in its place by arrival time, past the bound (see WaveRouter)."""
        self._q.insert(place(self._q, t), t)
        self._ids.add(t.id)

    def best_priority(self) -> int | None:
        """The best (lowest) priority queued here, None if empty."""
        return min((t.priority for t in self._q), default=None)

    def pick(self, running: list[float], now: float | None = None,
             priority: int | None = None) -> Ticket | None:
        """Remove and return the ticket a freed rank should start, given the forward costs
        of what the group's other ranks are running (empty if nothing); only one of
        ``priority`` when given."""
        q = [t for t in self._q if priority is None or t.priority == priority]
        if not q:
            return None
        now = time.monotonic() if now is None else now
        head = q[0]
        slowest = max(running, default=0.0)
        if now - head.enqueued_at >= self.starve_s or slowest <= 0:
            chosen = head
        else:
            fits = [t for t in q if t.cost <= slowest]
            if fits:
                chosen = max(fits, key=lambda t: (t.cost, -t.enqueued_at))
            else:
                chosen = min(q, key=lambda t: (t.cost, t.enqueued_at))
        self._q.remove(chosen)
        self._ids.discard(chosen.id)
        return chosen

    def record_latency(self, seconds: float) -> None:
        self._latency_s = seconds if self._latency_s == 0 else 0.8 * self._latency_s + 0.2 * seconds

    def retry_after_s(self) -> int:
        return max(1, math.ceil(self._latency_s))
