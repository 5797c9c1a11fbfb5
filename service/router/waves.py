"""Per-key FIFO queues that release waves of up to N compatible requests.

Pure Python (no Ray, no asyncio) so the scheduling rules are unit-tested with a fake clock.
Rules (design section 4, point 4): a wave only holds requests of one compatibility key,
because ranks in a wave must make the same collective calls; a wave forms when N requests
of a key wait or when the oldest has waited ``max_wait_s``; across keys the oldest head
goes first, so no key starves. With tenants (API keys, ``tenants.py``) whose turn it is
comes first: the key of that tenant's oldest ready request goes, and a wave is filled a
tenant at a time.

Priorities (lower first, router/priority.py): only a key holding a request of the best
priority queued may release a wave (a worse key waits, even when full, while a better one
fills or times out); the rules above hold among the requests of that priority, and the
wave takes its key's best priorities first, filling what is left with its worse ones (they
ride along: the wave's ranks would idle otherwise). A running wave's group frees only when
all its requests end: a better request waiting pauses the whole wave (the dispatcher, by
router/priority.py's ``wave_victims``) or goes at the next one.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from service.config.scheduler import SchedulerConfig
from service.router.queue import QueueFull, Ticket, place

if TYPE_CHECKING:
    from service.router.tenants import Tenants


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
    max_wait_s: float = SchedulerConfig.max_wait_ms / 1000
    max_queue: int = SchedulerConfig.queue_size
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

    def submit(self, ticket_id: str, key: str, payload: Any, now: float | None = None,
               tenant: str | None = None, priority: int = 0) -> Ticket:
        """Queue a request, or raise QueueFull so nothing unbounded piles up."""
        if ticket_id in self._ids:
            raise ValueError(f"duplicate ticket id {ticket_id}")
        if self.depth >= self.max_queue:
            raise QueueFull(self.depth, self.retry_after_s())
        t = Ticket(ticket_id, key, payload, time.monotonic() if now is None else now, tenant=tenant,
                   priority=priority)
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

    def put_back(self, t: Ticket) -> None:
        """Queue a ticket again (its group died under it) in its place by arrival time, past
        the bound: it was admitted once, a rank's death does not refuse it."""
        q = self._queues.setdefault(t.key, deque())
        q.insert(place(q, t), t)
        self._ids[t.id] = t.key

    def _ready(self, q: deque[Ticket], now: float, size: int | None = None) -> str | None:
        if len(q) >= (size or self.dp_size):
            return "full"
        if now - q[0].enqueued_at >= self.max_wait_s:
            return "timeout"
        return None

    def best_priority(self, tenants: Tenants | None = None) -> int | None:
        """The best (lowest) priority queued, of the tenants that may run when given."""
        return min((t.priority for q in self._queues.values() for t in q
                    if tenants is None or tenants.may_run(t.tenant)), default=None)

    def next_wave(self, now: float | None = None, size: int | None = None,
                  tenants: Tenants | None = None) -> Wave | None:
        """Release the ready key whose oldest request of the best priority waited longest (at
        most ``size`` requests, default ``dp_size``), or None if no such key is ready. With
        ``tenants``, whose turn it is decides instead (``_fair_wave``)."""
        now = time.monotonic() if now is None else now
        size = size or self.dp_size
        if tenants is not None:
            return self._fair_wave(now, size, tenants)
        best = self.best_priority()
        pick: tuple[float, str, str] | None = None
        for key, q in self._queues.items():
            head = next((t for t in q if t.priority == best), None)
            reason = self._ready(q, now, size) if head else None
            if reason and (pick is None or head.enqueued_at < pick[0]):
                pick = (head.enqueued_at, key, reason)
        if pick is None:
            return None
        _, key, reason = pick
        lane = sorted(self._queues[key], key=lambda t: t.priority)  # stable: arrival order within one
        return self._release(key, lane[:size], reason)

    def _fair_wave(self, now: float, size: int, tenants: Tenants) -> Wave | None:
        """The tenant whose turn it is (tenants.py) picks the key: its oldest request of the
        best priority whose key is ready. The wave is then filled from that key's requests,
        the best priority first, a tenant at a time within one priority, in turn order, each
        tenant's oldest first and within its ``max_running``."""
        best = self.best_priority(tenants)
        mine: dict[str | None, list[Ticket]] = {}
        for t in self.tickets():
            if t.priority == best:
                mine.setdefault(t.tenant, []).append(t)
        for tenant in tenants.order(mine):
            if not tenants.may_run(tenant):
                continue
            for t in mine[tenant]:
                reason = self._ready(self._queues[t.key], now, size)
                if reason:
                    return self._fill(t.key, size, tenant, tenants, reason)
        return None

    def _fill(self, key: str, size: int, first: str | None, tenants: Tenants, reason: str) -> Wave:
        lanes: dict[str | None, deque[Ticket]] = {}
        for t in sorted(self._queues[key], key=lambda t: t.priority):  # stable: arrival within one
            lanes.setdefault(t.tenant, deque()).append(t)
        turn = [first] + [x for x in tenants.order(lanes) if x != first]
        chosen: list[Ticket] = []
        taken: dict[str | None, int] = {}
        while len(chosen) < size:
            open_ = [x for x in turn if lanes.get(x) and tenants.may_run(x, taken.get(x, 0))]
            if not open_:
                break
            best = min(lanes[x][0].priority for x in open_)  # a round serves one priority
            for tenant in open_:
                if len(chosen) < size and lanes[tenant][0].priority == best:
                    chosen.append(lanes[tenant].popleft())
                    taken[tenant] = taken.get(tenant, 0) + 1
        return self._release(key, chosen, reason)

    def _release(self, key: str, chosen: list[Ticket], reason: str) -> Wave:
        """Take ``chosen`` (tickets of ``key``) off the queue as one wave."""
        ids = {t.id for t in chosen}
        self._queues[key] = deque(t for t in self._queues[key] if t.id not in ids)
        if not self._queues[key]:
            del self._queues[key]
        for t in chosen:
            del self._ids[t.id]
        return Wave(key, chosen, reason)

    def wake_in(self, now: float | None = None) -> float | None:
        """Seconds until a key that may release a wave (one holding the best priority queued)
        becomes ready on its own (0 if one is ready, None if empty)."""
        now = time.monotonic() if now is None else now
        best = self.best_priority()
        waits = []
        for q in self._queues.values():
            if not any(t.priority == best for t in q):
                continue
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
