"""Which queued request a free rank starts next: one interface, two policies.

- ``ContinuousScheduler`` (the default): a rank whose request has run its last forward
  takes the next request at once, of any shape (``ContinuousQueue.pick`` chooses which);
  in an AllGather group it joins at the next forward boundary while the others go on.
- ``WaveScheduler``: request-level waves as before: a group takes up to N requests of one
  compatibility key, only when none of its ranks is forwarding (``WaveRouter``).

Both serve the best (lowest) ``priority`` queued first (router/priority.py): continuous
scheduling at every freed rank, waves at every wave (a better request pauses one running
request, or under waves a whole wave: its group frees only when all of it ends). Both
share ranks fairly between tenants (API keys, ``tenants.py``), within a priority, and hold
each to its quota; ``fair=False`` keeps the policy of before (one queue for everyone, no
quotas), for the fairness benchmark (loadtest/bench_fairness.py) to compare against.

Pure Python with the clock passed in, so the dispatcher's tests drive it in milliseconds.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.config.scheduler import SchedulerConfig

from .continuous import ContinuousQueue
from .queue import QueueFull, Ticket
from .tenants import Tenants
from .waves import WaveRouter

SCHEDULERS = ("continuous", "waves")


@dataclass(frozen=True)
class Pick:
    """One assignment: ticket to scheduler rank ``rank``; ``info`` says why (for history)."""

    rank: int
    ticket: Ticket
    info: dict[str, Any]
    alongside: tuple[Any, ...]  # payloads forwarding on the group with it (its deadline's inputs)


class Scheduler(ABC):
    """The queue of one dispatcher: admission (global bound, tenants' quotas) and picks."""

    name: str
    max_queue: int

    def __init__(self, max_queue: int, tenants: Tenants | None, fair: bool) -> None:
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        self.max_queue = max_queue
        self.tenants = tenants or Tenants()
        self.fair = fair
        self._queued: Counter[str | None] = Counter()  # queued tickets by tenant
        self._tenant_of: dict[str, str | None] = {}
        self._latency_s = 0.0  # moving average of request latency, for Retry-After

    @property
    def depth(self) -> int:
        return len(self._tenant_of)

    def submit(self, ticket_id: str, key: str, payload: Any, cost: float, now: float,
               tenant: str | None = None, priority: int = 0) -> Ticket:
        """Queue a request: QuotaExceeded when the tenant's own queue is full, QueueFull
        when the whole queue is."""
        if ticket_id in self._tenant_of:
            raise ValueError(f"duplicate ticket id {ticket_id}")
        self.admit(tenant)
        t = self._enqueue(ticket_id, key, payload, cost, now, tenant)
        t.priority = priority
        self._tenant_of[ticket_id] = tenant
        self._queued[tenant] += 1
        return t

    def admit(self, tenant: str | None) -> None:
        """QuotaExceeded or QueueFull if a request of ``tenant`` would be refused now (asked
        before a request's image is decoded, and again by ``submit``)."""
        if self.fair:
            self.tenants.admit(tenant, self._queued[tenant], self._latency_s)
        if self.depth >= self.max_queue:
            raise QueueFull(self.depth, self.retry_after_s())

    def cancel(self, ticket_id: str) -> bool:
        if ticket_id not in self._tenant_of or not self._dequeue(ticket_id):
            return False
        self._forget(ticket_id)
        return True

    def has(self, ticket_id: str) -> bool:
        return ticket_id in self._tenant_of

    def requeue(self, t: Ticket) -> None:
        """A handed-out ticket goes back to the queue (its rank group died under it), ahead of
        later arrivals; neither the bound nor the tenant's quota refuses it."""
        self._put_back(t)
        self._tenant_of[t.id] = t.tenant
        self._queued[t.tenant] += 1

    def finished(self, ticket: Ticket) -> None:
        """A ticket this scheduler handed out has ended (its rank no longer holds it)."""
        self.tenants.finished(ticket.tenant)

    def counts(self, tenant: str | None) -> dict[str, int]:
        """The tenant's own numbers: queued here, held by ranks."""
        return {"queued": self._queued[tenant], "running": self.tenants.running[tenant]}

    def record_latency(self, seconds: float) -> None:
        self._latency_s = seconds if self._latency_s == 0 else 0.8 * self._latency_s + 0.2 * seconds

    def retry_after_s(self) -> int:
        """Rough time until a queue slot frees: about one request's latency."""
        return max(1, math.ceil(self._latency_s))

    def wake_in(self, now: float) -> float:
        """Seconds until the queue may release something on its own (waves' timeout)."""
        return 0.05

    def _handed_out(self, t: Ticket) -> None:
        self._forget(t.id)
        self.tenants.started(t.tenant)

    def _forget(self, ticket_id: str) -> None:
        tenant = self._tenant_of.pop(ticket_id)
        self._queued[tenant] -= 1
        if not self._queued[tenant]:
            del self._queued[tenant]

    @abstractmethod
    def _enqueue(self, ticket_id: str, key: str, payload: Any, cost: float, now: float,
                 tenant: str | None) -> Ticket: ...

    @abstractmethod
    def _dequeue(self, ticket_id: str) -> bool: ...

    @abstractmethod
    def _put_back(self, t: Ticket) -> None: ...

    @abstractmethod
    def take(self, size: int, running: dict[int, Ticket], now: float) -> list[Pick]:
        """Assignments for a group of ``size`` ranks, ``running`` the tickets its ranks are
        forwarding (by rank); free ranks are those not in it."""

    def join(self, match: Callable[[Ticket], bool], now: float) -> Ticket | None:
        """The oldest queued ticket ``match`` accepts, to share a running batch's forwards
        (engine/batching.py): of the best priority queued, of a tenant that may run now."""
        may = [t for t in self.queued() if not self.fair or self.tenants.may_run(t.tenant)]
        best = min((t.priority for t in may), default=None)
        for t in may:
            if t.priority == best and match(t) and self._dequeue(t.id):
                self._handed_out(t)
                return t
        return None

    @abstractmethod
    def queued(self) -> list[Ticket]:
        """Every queued ticket, oldest first (not removed)."""


class ContinuousScheduler(Scheduler):
    """One ContinuousQueue per tenant: whose turn it is picks the queue, the queue's own
    rule (cost, starvation) picks the request."""

    name = "continuous"

    def __init__(self, max_queue: int = SchedulerConfig.queue_size,
                 starve_s: float = SchedulerConfig.starve_s, tenants: Tenants | None = None,
                 fair: bool = True) -> None:
        super().__init__(max_queue, tenants, fair)
        self.starve_s = starve_s
        self._lanes: dict[str | None, ContinuousQueue] = {}

    def _lane(self, tenant: str | None) -> str | None:
        return tenant if self.fair else None

    def _enqueue(self, ticket_id: str, key: str, payload: Any, cost: float, now: float,
                 tenant: str | None) -> Ticket:
        lane = self._lanes.setdefault(self._lane(tenant), ContinuousQueue(self.max_queue, self.starve_s))
        return lane.submit(ticket_id, key, payload, cost, now=now, tenant=tenant)

    def _dequeue(self, ticket_id: str) -> bool:
        lane = self._lane(self._tenant_of[ticket_id])
        q = self._lanes.get(lane)
        if q is None or not q.cancel(ticket_id):
            return False
        if not q.depth:
            del self._lanes[lane]
        return True

    def _put_back(self, t: Ticket) -> None:
        lane = self._lanes.setdefault(self._lane(t.tenant), ContinuousQueue(self.max_queue, self.starve_s))
        lane.put_back(t)

    def _pick(self, costs: list[float], now: float) -> Ticket | None:
        """The best priority queued among the tenants that may run goes first; within it,
        whose turn it is picks the queue."""
        lanes = [lane for lane, q in self._lanes.items() if q.depth]
        turn = [x for x in self.tenants.order(lanes) if self.tenants.may_run(x)] if self.fair else lanes
        best = min((p for lane in turn if (p := self._lanes[lane].best_priority()) is not None), default=None)
        for lane in turn:
            q = self._lanes[lane]
            t = q.pick(costs, now=now, priority=best)
            if t is None:
                continue
            if not q.depth:
                del self._lanes[lane]
            self._handed_out(t)
            return t
        return None

    def take(self, size: int, running: dict[int, Ticket], now: float) -> list[Pick]:
        picks: list[Pick] = []
        busy = dict(running)
        for r in range(size):
            if r in busy:
                continue
            t = self._pick([x.cost for x in busy.values()], now)
            if t is None:
                break
            others = tuple(x.payload for x in busy.values())
            picks.append(Pick(r, t, {"scheduler": self.name, "key": t.key, "size": 1, "reason": "free_rank"},
                              others + (t.payload,)))
            busy[r] = t
        return picks

    def queued(self) -> list[Ticket]:
        return sorted((t for q in self._lanes.values() for t in q.tickets()), key=lambda t: t.enqueued_at)


class WaveScheduler(Scheduler):
    name = "waves"

    def __init__(self, dp_size: int, max_wait_s: float = SchedulerConfig.max_wait_ms / 1000,
                 max_queue: int = SchedulerConfig.queue_size,
                 tenants: Tenants | None = None, fair: bool = True) -> None:
        super().__init__(max_queue, tenants, fair)
        self.router = WaveRouter(dp_size, max_wait_s, max_queue)

    def _enqueue(self, ticket_id: str, key: str, payload: Any, cost: float, now: float,
                 tenant: str | None) -> Ticket:
        t = self.router.submit(ticket_id, key, payload, now=now, tenant=tenant)
        t.cost = cost
        return t

    def _dequeue(self, ticket_id: str) -> bool:
        return self.router.cancel(ticket_id)

    def _put_back(self, t: Ticket) -> None:
        self.router.put_back(t)

    def take(self, size: int, running: dict[int, Ticket], now: float) -> list[Pick]:
        if running:
            return []  # a wave starts only when the whole group is free
        wave = self.router.next_wave(now=now, size=size, tenants=self.tenants if self.fair else None)
        if wave is None:
            return []
        for t in wave.tickets:
            self._handed_out(t)
        info = {"scheduler": self.name, "key": wave.key, "size": wave.size, "reason": wave.reason}
        payloads = tuple(t.payload for t in wave.tickets)
        return [Pick(r, t, info, payloads) for r, t in enumerate(wave.tickets)]

    def queued(self) -> list[Ticket]:
        return self.router.tickets()

    def wake_in(self, now: float) -> float:
        w = self.router.wake_in(now)
        return 0.05 if w is None else max(0.005, min(w, 0.05))


def make_scheduler(name: str, dp_size: int, max_queue: int, starve_s: float, max_wait_s: float,
                   tenants: Tenants | None = None, fair: bool = True) -> Scheduler:
    if name == "continuous":
        return ContinuousScheduler(max_queue, starve_s, tenants, fair)
    if name == "waves":
        return WaveScheduler(dp_size, max_wait_s, max_queue, tenants, fair)
    raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {name!r}")
