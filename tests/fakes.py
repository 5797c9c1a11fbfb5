"""The in-memory executor and clock the scheduling tests drive (no Ray, no processes).

A fake is right here: the dispatcher's rules (deadlines, rebuilds, cancel, lost groups,
retries) are about what the executor *reports*, and the real executors' reports are tested
on real Ray actors and processes elsewhere. Every event is one the test asks for.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from service.config import EngineConfig
from service.engine.events import Event, EventKind
from service.engine.executor import Executor, GroupInfo, GroupState


@dataclass
class Clock:
    """A monotonic clock that moves only when the test says so."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class FakeExecutor(Executor):
    """Groups of the given sizes; ``collective`` as an AllGather group (size > 1) would be.

    ``outcomes[group]``: results of its next start/rebuild attempts (True: ready), popped in
    order; when empty, attempts succeed. Nothing happens by itself: the test calls
    ``run``/``finish``/``kill`` and then the dispatcher's ``step``.
    """

    sizes: tuple[int, ...] = (2,)
    outcomes: dict[int, list[bool]] = field(default_factory=dict)
    assigned: list[tuple[str, int, str, Any]] = field(default_factory=list)
    cancels: list[tuple[str, int, str]] = field(default_factory=list)
    attempts: dict[str, int] = field(default_factory=dict)
    closed: bool = False
    started: bool = False
    _infos: list[GroupInfo] = field(default_factory=list)
    _states: dict[str, GroupState] = field(default_factory=dict)
    _events: deque[Event] = field(default_factory=deque)
    _where: dict[str, tuple[str, int]] = field(default_factory=dict)  # job -> (group, rank)
    _cv: threading.Condition = field(default_factory=threading.Condition)  # a dispatcher thread may poll
    config: EngineConfig = field(default_factory=EngineConfig)  # what it runs (Executor.config)

    def __post_init__(self) -> None:
        first = 0
        for i, size in enumerate(self.sizes):
            info = GroupInfo(f"g{i}", size, first, size > 1)
            self._infos.append(info)
            self._states[info.id] = GroupState.NEW
            first += size

    # -- Executor ---------------------------------------------------------------------
    def start(self) -> None:
        self.started = True
        for info in self._infos:
            self._attempt(info.id)

    def groups(self) -> list[GroupInfo]:
        return list(self._infos)

    def state(self, group: str) -> GroupState:
        return self._states[group]

    def assign(self, group: str, rank: int, job_id: str, req: Any) -> None:
        if self._states[group] is not GroupState.READY:
            raise RuntimeError(f"group {group} is {self._states[group].value}")
        with self._cv:
            self.assigned.append((group, rank, job_id, req))
            self._where[job_id] = (group, rank)
            self._cv.notify_all()

    def cancel(self, group: str, rank: int, job_id: str) -> None:
        with self._cv:
            self.cancels.append((group, rank, job_id))
            self._cv.notify_all()

    def wait_cancelled(self, job_id: str, timeout: float = 10.0) -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: any(c[2] == job_id for c in self.cancels), timeout)

    def poll(self, timeout: float) -> list[Event]:
        with self._cv:
            if not self._events and timeout > 0:
                self._cv.wait(timeout)
            out = list(self._events)
            self._events.clear()
            return out

    def fail(self, group: str, reason: str) -> None:
        self._states[group] = GroupState.BROKEN

    def rebuild(self, group: str) -> bool:
        if self.closed or self._states[group] not in (GroupState.BROKEN, GroupState.FAILED):
            return False
        self._attempt(group)
        return True

    def status(self) -> dict[str, Any]:
        return {"groups": [{"group": g.id, "state": self._states[g.id].value, "size": g.size,
                            "generation": self.attempts[g.id] - 1, "rebuilds": self.attempts[g.id] - 1,
                            "first_rank": g.first_rank, "last_error": None, "workers": []}
                           for g in self._infos],
                "dp_size": sum(self.sizes), "sp_size": 1, "offload_mode": {"mode": "fake", "reason": "test"}}

    def close(self) -> None:
        self.closed = True
        for g in self._infos:
            self._states[g.id] = GroupState.CLOSED

    # -- what the test makes happen ---------------------------------------------------
    def run(self, job_id: str, steps: int = 2, mp4: bytes | None = None, error: str | None = None,
            cancelled: bool = False) -> None:
        """The job's rank reports its steps, its last forward and its end."""
        self.forwards_done(job_id, steps)
        self.finish(job_id, mp4=mp4, error=error, cancelled=cancelled)

    def forwards_done(self, job_id: str, steps: int = 2) -> None:
        group, rank = self._where[job_id]
        self._push(Event(EventKind.STARTED, group=group, rank=rank, job_id=job_id),
                   *(Event(EventKind.STEP, group=group, rank=rank, job_id=job_id, step=s, total=steps)
                     for s in range(1, steps + 1)),
                   Event(EventKind.FORWARDS_DONE, group=group, rank=rank, job_id=job_id))

    def begin(self, job_id: str, not_resumable: str = "") -> None:
        """The job's rank took it (and says why it keeps no state of it, if it does not)."""
        group, rank = self._where[job_id]
        self._push(Event(EventKind.STARTED, group=group, rank=rank, job_id=job_id,
                         not_resumable=not_resumable))

    def step(self, job_id: str, step: int, total: int, preview: bytes | None = None) -> None:
        """One step's end: the progress event, and the preview's when ``preview`` is given."""
        group, rank = self._where[job_id]
        self._push(Event(EventKind.STEP, group=group, rank=rank, job_id=job_id, step=step, total=total),
                   *([Event(EventKind.STEP, group=group, rank=rank, job_id=job_id, step=step, total=total,
                            preview=preview)] if preview is not None else []))

    def finish(self, job_id: str, mp4: bytes | None = None, error: str | None = None,
               cancelled: bool = False) -> None:
        group, rank = self._where[job_id]
        data = None if error or cancelled else (mp4 or f"mp4 of {job_id}".encode())
        self._push(Event(EventKind.FINISHED, group=group, rank=rank, job_id=job_id, mp4=data,
                         error="cancelled" if cancelled else error, cancelled=cancelled, seconds=1.0,
                         timings={"text_encode_s": 0.1, "denoise_s": 0.5, "decode_s": 0.1, "encode_s": 0.2}))

    def hand_off(self, job_id: str, state: Any) -> None:
        """The job's rank hands off its state after ``state.step`` (a STEP with the state)."""
        group, rank = self._where[job_id]
        self._push(Event(EventKind.STEP, group=group, rank=rank, job_id=job_id, step=state.step,
                         total=state.total, state=state))

    def kill(self, group: str, why: str = "rank 0 died: killed", rank: int = 0) -> None:
        """Rank ``rank`` of ``group`` died (or failed: ``why``): the executor reports the group failed."""
        self._states[group] = GroupState.BROKEN
        self._push(Event(EventKind.GROUP_FAILED, group=group, rank=rank, error=why))

    def refuse(self, job_id: str, why: str = "ValueError: nope") -> None:
        group, rank = self._where[job_id]
        self._push(Event(EventKind.REFUSED, group=group, rank=rank, job_id=job_id, error=why))

    def on(self, job_id: str) -> tuple[str, int]:
        """Where the job was assigned (group, rank)."""
        return self._where[job_id]

    def wait_assigned(self, job_id: str, timeout: float = 10.0) -> tuple[str, int]:
        """For tests with a dispatcher thread: block until ``job_id`` reached a rank."""
        with self._cv:
            assert self._cv.wait_for(lambda: job_id in self._where, timeout), f"{job_id} never assigned"
            return self._where[job_id]

    # -- internals --------------------------------------------------------------------
    def _attempt(self, group: str) -> None:
        self.attempts[group] = self.attempts.get(group, 0) + 1
        index = int(group[1:])
        planned = self.outcomes.get(index, [])
        ok = planned.pop(0) if planned else True
        self._states[group] = GroupState.READY if ok else GroupState.FAILED
        kind = EventKind.GROUP_READY if ok else EventKind.START_FAILED
        self._push(Event(kind, group=group, error=None if ok else f"attempt {self.attempts[group]} failed"))

    def _push(self, *events: Event) -> None:
        with self._cv:
            self._events.extend(events)
            self._cv.notify_all()


class RecordingSink:
    """A dispatcher Sink that remembers every start, step and outcome, and lets a test wait
    for them (the dispatcher may run on its own thread)."""

    def __init__(self) -> None:
        self.started: dict[str, dict[str, Any]] = {}
        self.finished: dict[str, Any] = {}  # id -> Outcome
        self.progress: dict[str, int] = {}  # id -> last step
        self.requeued: list[tuple[str, str]] = []  # (id, why), in order
        self._cv = threading.Condition()

    def on_start(self, ticket: Any, info: dict[str, Any]) -> None:
        with self._cv:
            self.started[ticket.id] = dict(info)
            self._cv.notify_all()

    def on_progress(self, ticket_id: str, step: int, total: int) -> None:
        with self._cv:
            self.progress[ticket_id] = step
            self._cv.notify_all()

    def on_requeue(self, ticket: Any, why: str) -> None:
        with self._cv:
            self.requeued.append((ticket.id, why))
            self._cv.notify_all()

    def on_finish(self, ticket: Any, outcome: Any, info: dict[str, Any]) -> None:
        with self._cv:
            assert ticket.id not in self.finished, f"{ticket.id} ended twice"
            self.finished[ticket.id] = outcome
            self._cv.notify_all()

    def reset(self) -> None:
        """Forget everything recorded: the next test of a shared dispatcher starts clean (its
        jobs have all ended, so nothing of theirs is still to come)."""
        with self._cv:
            self.started.clear()
            self.finished.clear()
            self.progress.clear()
            self.requeued.clear()

    def until(self, cond: Any, timeout: float = 180) -> None:
        with self._cv:
            assert self._cv.wait_for(cond, timeout), (self.finished, self.progress)

    def wait(self, ids: list[str], timeout: float = 180) -> list[Any]:
        self.until(lambda: all(i in self.finished for i in ids), timeout)
        return [self.finished[i] for i in ids]

    def wait_progress(self, job_id: str, steps: int = 1, timeout: float = 120) -> None:
        self.until(lambda: self.progress.get(job_id, 0) >= steps, timeout)
