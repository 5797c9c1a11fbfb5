"""Per-key FIFO queues that release waves of up to N compatible requests.

Pure Python (no Ray, no asyncio) so the scheduling rules are unit-tested with a fake clock.
Rules (design section 4, point 4): a wave only holds requests of one compatibility key,
because ranks in a wave must make the same collective calls; a wave forms when N requests
of a key wait or when the oldest has waited ``max_wait_s``; across keys the oldest head
goes first, so no key starves.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any


class QueueFull(Exception):
    """The bounded queue is full; the caller should answer 429 with ``retry_after_s``."""

    def __init__(self, depth: int, retry_after_s: int) -> None:
        super().__init__(f"queue full ({depth} waiting); retry after {retry_after_s}s")
        self.depth = depth
        self.retry_after_s = retry_after_s


@dataclass
class Ticket:
    """One queued request: its id, compatibility key, payload and arrival time."""

    id: str
    key: str
    payload: Any
    enqueued_at: float
    cost: float = 1.0  # relative time of one forward (continuous scheduling weighs it)


@dataclass
class Wave:
    """Requests released together; rank r of the DP group runs ``tickets[r]``."""

    key: str
    tickets: list[Ticket]
    reason: str  # "full" (N waited) or "timeout" (oldest waited max_wait_s)

    @property
    def size(self) -> int:
        return len(self.tickets)


@dataclass
class WaveRouter:
    """Bounded per-key FIFO queues and the wave-forming policy."""

    dp_size: int
    max_wait_s: float = 0.05
    max_queue: int = 64
    _queues: OrderedDict[str, deque[Ticket]] = field(default_factory=OrderedDict)
    _ids: dict[str, str] = field(default_factory=dict)  # ticket id -> key
    _wave_s: float = 0.0  # moving average of wave latency, for Retry-After

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError("dp_size must be >= 1")
        if self.max_queue < 1:
            raise ValueError("max_queue must be >= 1")

    @property
    def depth(self) -> int:
        return len(self._ids)

    def submit(self, ticket_id: str, key: str, payload: Any, now: float | None = None) -> Ticket:
        """Queue a request, or raise QueueFull so nothing unbounded piles up."""
        if ticket_id in self._ids:
            raise ValueError(f"duplicate ticket id {ticket_id}")
        if self.depth >= self.max_queue:
            raise QueueFull(self.depth, self.retry_after_s())
        t = Ticket(ticket_id, key, payload, time.monotonic() if now is None else now)
        self._queues.setdefault(key, deque()).append(t)
        self._ids[ticket_id] = key
        return t

    def tickets(self) -> list[Ticket]:
        """Every queued ticket, oldest first (not removed)."""
        return sorted((t for q in self._queues.values() for t in q), key=lambda t: t.enqueued_at)

    def cancel(self, ticket_id: str) -> bool:
        """Drop a queued request (e.g. DELETE before it ran); False if not queued."""
        key = self._ids.pop(ticket_id, None)
        if key is None:
            return False
        q = self._queues[key]
        for t in q:
            if t.id == ticket_id:
                q.remove(t)
                break
        if not q:
            del self._queues[key]
        return True

    def _ready(self, q: deque[Ticket], now: float, size: int | None = None) -> str | None:
        if len(q) >= (size or self.dp_size):
            return "full"
        if now - q[0].enqueued_at >= self.max_wait_s:
            return "timeout"
        return None

    def next_wave(self, now: float | None = None, size: int | None = None) -> Wave | None:
        """Release the ready key whose head waited longest (at most ``size`` requests, default
        ``dp_size``), or None if no key is ready."""
        now = time.monotonic() if now is None else now
        size = size or self.dp_size
        best: tuple[float, str, str] | None = None
        for key, q in self._queues.items():
            reason = self._ready(q, now, size)
            if reason and (best is None or q[0].enqueued_at < best[0]):
                best = (q[0].enqueued_at, key, reason)
        if best is None:
            return None
        _, key, reason = best
        q = self._queues[key]
        tickets = [q.popleft() for _ in range(min(size, len(q)))]
        if not q:
            del self._queues[key]
        for t in tickets:
            del self._ids[t.id]
        return Wave(key, tickets, reason)

    def wake_in(self, now: float | None = None) -> float | None:
        """Seconds until some key becomes ready on its own (0 if one is ready, None if empty)."""
        now = time.monotonic() if now is None else now
        waits = []
        for q in self._queues.values():
            if self._ready(q, now):
                return 0.0
            waits.append(q[0].enqueued_at + self.max_wait_s - now)
        return max(0.0, min(waits)) if waits else None

    def record_wave_latency(self, seconds: float) -> None:
        """Feed the Retry-After estimate with what waves really take."""
        self._wave_s = seconds if self._wave_s == 0 else 0.8 * self._wave_s + 0.2 * seconds

    def retry_after_s(self) -> int:
        """Rough time until a queue slot frees: the next wave's end, ~ mean wave latency."""
        return max(1, math.ceil(self._wave_s))
