"""Which queued request a free rank starts next: one interface, two policies.

- ``ContinuousScheduler`` (the default): a rank whose request has run its last forward
  takes the next request at once, of any shape (``ContinuousQueue.pick`` chooses which);
  in an AllGather group it joins at the next forward boundary while the others go on.
- ``WaveScheduler``: request-level waves as before: a group takes up to N requests of one
  compatibility key, only when none of its ranks is forwarding (``WaveRouter``).

Pure Python with the clock passed in, so the dispatcher's tests drive it in milliseconds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from .continuous import ContinuousQueue
from .waves import Ticket, WaveRouter

SCHEDULERS = ("continuous", "waves")


@dataclass(frozen=True)
class Pick:
    """One assignment: ticket to scheduler rank ``rank``; ``info`` says why (for history)."""

    rank: int
    ticket: Ticket
    info: dict[str, Any]
    alongside: tuple[Any, ...]  # payloads forwarding on the group with it (its deadline's inputs)


class Scheduler(ABC):
    name: str
    max_queue: int

    @property
    @abstractmethod
    def depth(self) -> int: ...

    @abstractmethod
    def submit(self, ticket_id: str, key: str, payload: Any, cost: float, now: float) -> Ticket:
        """Queue a request; QueueFull when the bound is reached."""

    @abstractmethod
    def cancel(self, ticket_id: str) -> bool: ...

    @abstractmethod
    def take(self, size: int, running: dict[int, Ticket], now: float) -> list[Pick]:
        """Assignments for a group of ``size`` ranks, ``running`` the tickets its ranks are
        forwarding (by rank); free ranks are those not in it."""

    @abstractmethod
    def queued(self) -> list[Ticket]:
        """Every queued ticket, oldest first (not removed)."""

    @abstractmethod
    def record_latency(self, seconds: float) -> None: ...

    @abstractmethod
    def retry_after_s(self) -> int: ...

    def wake_in(self, now: float) -> float:
        """Seconds until the queue may release something on its own (waves' timeout)."""
        return 0.05


class ContinuousScheduler(Scheduler):
    name = "continuous"

    def __init__(self, max_queue: int = 64, starve_s: float = 30.0) -> None:
        self.queue = ContinuousQueue(max_queue, starve_s)
        self.max_queue = max_queue

    @property
    def depth(self) -> int:
        return self.queue.depth

    def submit(self, ticket_id: str, key: str, payload: Any, cost: float, now: float) -> Ticket:
        return self.queue.submit(ticket_id, key, payload, cost, now=now)

    def cancel(self, ticket_id: str) -> bool:
        return self.queue.cancel(ticket_id)

    def take(self, size: int, running: dict[int, Ticket], now: float) -> list[Pick]:
        picks: list[Pick] = []
        busy = dict(running)
        for r in range(size):
            if r in busy:
                continue
            t = self.queue.pick([x.cost for x in busy.values()], now=now)
            if t is None:
                break
            others = tuple(x.payload for x in busy.values())
            picks.append(Pick(r, t, {"scheduler": self.name, "key": t.key, "size": 1, "reason": "free_rank"},
                              others + (t.payload,)))
            busy[r] = t
        return picks

    def queued(self) -> list[Ticket]:
        return list(self.queue.tickets())

    def record_latency(self, seconds: float) -> None:
        self.queue.record_latency(seconds)

    def retry_after_s(self) -> int:
        return self.queue.retry_after_s()


class WaveScheduler(Scheduler):
    name = "waves"

    def __init__(self, dp_size: int, max_wait_s: float = 0.05, max_queue: int = 64) -> None:
        self.router = WaveRouter(dp_size, max_wait_s, max_queue)
        self.max_queue = max_queue

    @property
    def depth(self) -> int:
        return self.router.depth

    def submit(self, ticket_id: str, key: str, payload: Any, cost: float, now: float) -> Ticket:
        t = self.router.submit(ticket_id, key, payload, now=now)
        t.cost = cost
        return t

    def cancel(self, ticket_id: str) -> bool:
        return self.router.cancel(ticket_id)

    def take(self, size: int, running: dict[int, Ticket], now: float) -> list[Pick]:
        if running:
            return []  # a wave starts only when the whole group is free
        wave = self.router.next_wave(now=now, size=size)
        if wave is None:
            return []
        info = {"scheduler": self.name, "key": wave.key, "size": wave.size, "reason": wave.reason}
        payloads = tuple(t.payload for t in wave.tickets)
        return [Pick(r, t, info, payloads) for r, t in enumerate(wave.tickets)]

    def queued(self) -> list[Ticket]:
        return self.router.tickets()

    def record_latency(self, seconds: float) -> None:
        self.router.record_wave_latency(seconds)

    def retry_after_s(self) -> int:
        return self.router.retry_after_s()

    def wake_in(self, now: float) -> float:
        w = self.router.wake_in(now)
        return 0.05 if w is None else max(0.005, min(w, 0.05))


def make_scheduler(name: str, dp_size: int, max_queue: int, starve_s: float, max_wait_s: float) -> Scheduler:
    if name == "continuous":
        return ContinuousScheduler(max_queue, starve_s)
    if name == "waves":
        return WaveScheduler(dp_size, max_wait_s, max_queue)
    raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {name!r}")
