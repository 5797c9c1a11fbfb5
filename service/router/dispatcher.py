"""The loop that feeds queued requests to an engine's rank groups and reports how they end.

A plain thread, shared by the HTTP ingress and the batch job so both schedule the same
way. Two schedulers:

- ``continuous``: a rank whose request has run its last forward takes the next queued
  request at once, of any shape (``ContinuousQueue.pick`` chooses which); in an
  AllGather group it joins at the next forward boundary while the others go on.
- ``waves``: request-level waves as before: a group takes up to N requests of one
  compatibility key only when all its ranks are free (``WaveRouter``).

Every accepted request ends: completed, or failed with a reason (its rank died, its group
missed a deadline, the engine is gone). A group that fails takes exactly the requests it
held; queued requests wait for a rebuilt or another group. Rebuilds run on their own
threads, so one rank-local rank rebuilding does not stop the others.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import ray

from service.engine.group import Engine, GroupFailure, GroupState, Outcome, RankGroup
from service.engine.metrics import metrics
from service.router.continuous import ContinuousQueue
from service.router.policy import DeadlinePolicy
from service.router.waves import Ticket, WaveRouter

log = logging.getLogger("dloserve.router")
SCHEDULERS = ("continuous", "waves")


class Sink(Protocol):
    """Where job state goes (the HTTP job store, the batch manifest)."""

    def on_start(self, ticket: Ticket, info: dict[str, Any]) -> None: ...

    def on_progress(self, ticket_id: str, step: int, total: int) -> None: ...

    def on_finish(self, ticket: Ticket, outcome: Outcome, info: dict[str, Any]) -> None: ...


@dataclass
class Held:
    """A request a rank holds, from assignment until its MP4 (or error) comes back."""

    ticket: Ticket
    group: RankGroup
    rank: int
    assigned_at: float
    deadline: float
    info: dict[str, Any]
    forwarding: bool = True  # False once its last forward ran (decode/encode remain)


def request_cost(req: Any) -> float:
    """Relative cost of one forward: pixels x frames (tokens, up to the model's constant)."""
    return float(req.width * req.height * req.num_frames)


@dataclass
class Dispatcher:
    """Owns the queue and the engine; ``submit`` from any thread, scheduling on one thread."""

    engine: Engine
    sink: Sink
    scheduler: str = "continuous"
    max_wait_s: float = 0.05
    max_queue: int = 64
    deadlines: DeadlinePolicy = field(default_factory=DeadlinePolicy)
    starve_s: float = 30.0
    retry_s: float = 5.0
    history: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=256))
    assignments: int = 0  # waves (waves) or single assignments (continuous) so far
    _cv: threading.Condition = field(default_factory=threading.Condition)
    _stop: bool = False
    _thread: threading.Thread | None = None
    _held: dict[str, Held] = field(default_factory=dict)
    _rebuilding: set[str] = field(default_factory=set)
    _unavailable_since: float | None = None

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}")
        size = max(g.size for g in self.engine.groups)
        self.waves = WaveRouter(size, self.max_wait_s, self.max_queue)
        self.queue = ContinuousQueue(self.max_queue, self.starve_s)

    # -- any thread --------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="dloserve-dispatch", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.close()

    def submit(self, ticket_id: str, key: str, payload: Any) -> Ticket:
        """Queue one validated request; raises QueueFull when the bound is reached."""
        with self._cv:
            if self.scheduler == "waves":
                t = self.waves.submit(ticket_id, key, payload)
                t.cost = request_cost(payload)
            else:
                t = self.queue.submit(ticket_id, key, payload, request_cost(payload))
            self._depth()
            self._cv.notify_all()
            return t

    def cancel(self, ticket_id: str) -> bool:
        with self._cv:
            ok = self.waves.cancel(ticket_id) or self.queue.cancel(ticket_id)
            self._depth()
            return ok

    @property
    def depth(self) -> int:
        return self.waves.depth + self.queue.depth

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def unavailable_since(self) -> float | None:
        """Since when no group can serve or is about to (None while one can)."""
        return self._unavailable_since

    def fail_queued(self, why: str) -> int:
        """End every queued request as failed with ``why`` (a drain); returns how many."""
        with self._cv:
            n = self.depth
            self._fail_queue(why)
            return n

    # -- the loop ----------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.engine.start()
        except Exception:  # noqa: BLE001 - the loop must live on: requests fail with the reason
            log.exception("engine failed to start")
        while True:
            with self._cv:
                if self._stop:
                    self._fail_all("service stopped")
                    return
            try:
                self._step()
            except Exception as e:  # noqa: BLE001 - never let the loop die with requests in hand
                log.exception("dispatcher step crashed")
                self._fail_all(f"internal error: {e}")
                time.sleep(0.5)

    def _step(self) -> None:
        self._recover()
        with self._cv:
            self._assign()
            self._depth()
        for g in self.engine.groups:
            if g.ready and not g.serving and any(h.forwarding for h in self._of(g)):
                g.serve()
        refs = [r for g in self.engine.groups if g.ready for r in g.refs()]
        if not refs:
            with self._cv:
                self._cv.wait(timeout=self._wake_in())
            self._check_deadlines()
            return
        ready, _ = ray.wait(refs, num_returns=1, timeout=self._wake_in())
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in ready:
            g = next((g for g in self.engine.groups if g.owns(ref)), None)
            if g is None or not g.ready:
                continue
            try:
                events = g.take(ref)
            except GroupFailure as e:
                self._group_failed(g, str(e))
                continue
            for ev in events:
                self._on_event(g, ev)
        self._check_deadlines()

    def _wake_in(self) -> float:
        if self.scheduler == "waves":
            w = self.waves.wake_in()
            return 0.05 if w is None else max(0.005, min(w, 0.05))
        return 0.05

    # -- assignment --------------------------------------------------------------------
    def _of(self, g: RankGroup) -> list[Held]:
        return [h for h in self._held.values() if h.group is g]

    def _assign(self) -> None:
        for g in self.engine.groups:
            if not g.ready:
                continue
            held = self._of(g)
            if self.scheduler == "waves":
                if any(h.forwarding for h in held):
                    continue
                wave = self.waves.next_wave()
                if wave is None:
                    continue
                info = {"scheduler": "waves", "wave": self.assignments, "key": wave.key,
                        "size": wave.size, "reason": wave.reason}
                self.assignments += 1
                for r, t in enumerate(wave.tickets):
                    self._give(g, r, t, info, [x.payload for x in wave.tickets])
                continue
            busy = {h.rank for h in held if h.forwarding}
            for r in range(g.size):
                if r in busy:
                    continue
                running = [h.ticket.cost for h in self._of(g) if h.forwarding]
                t = self.queue.pick(running)
                if t is None:
                    break
                info = {"scheduler": "continuous", "wave": self.assignments, "key": t.key, "size": 1,
                        "reason": "free_rank"}
                self.assignments += 1
                others = [h.ticket.payload for h in self._of(g) if h.forwarding]
                self._give(g, r, t, info, others + [t.payload])
                busy.add(r)

    def _give(self, g: RankGroup, rank: int, t: Ticket, info: dict[str, Any], alongside: list[Any]) -> None:
        now = time.monotonic()
        deadline = self.deadlines.deadline_s(alongside)
        rec = {
            **info,
            "ids": [t.id],
            "group": g.group_id,
            "rank": g.first_bundle + rank,
            "generation": g.generation,
            "deadline_s": round(deadline, 1),
            "started_at": time.time(),
            "queued_s": round(now - t.enqueued_at, 3),
        }
        self.history.append(rec)
        self._held[t.id] = Held(t, g, rank, now, now + deadline, rec)
        metrics()["wave_size"].observe(info["size"], tags={"group": g.group_id})
        metrics()["assignments"].inc(1, tags={"scheduler": info["scheduler"], "reason": info["reason"]})
        self.sink.on_start(t, rec)
        g.assign(rank, t.id, t.payload)

    # -- events ------------------------------------------------------------------------
    def _on_event(self, g: RankGroup, ev: dict[str, Any]) -> None:
        kind = ev["kind"]
        h = self._held.get(ev.get("id", ""))
        if kind == "step" and h is not None:
            self.sink.on_progress(h.ticket.id, ev["step"], ev["total"])
        elif kind == "forwards_done" and h is not None:
            h.forwarding = False
            with self._cv:
                self._cv.notify_all()
        elif kind == "finished" and h is not None:
            self._end(h, Outcome(h.group.first_bundle + h.rank, ev.get("mp4"), ev.get("error"),
                                 float(ev.get("seconds") or 0.0)))
        elif kind == "refused":
            for h in [x for x in self._of(g) if x.rank == ev["rank"] and x.forwarding]:
                self._end(h, Outcome(g.first_bundle + h.rank, error=f"rank refused: {ev['error']}"))

    def _end(self, h: Held, outcome: Outcome) -> None:
        self._held.pop(h.ticket.id, None)
        latency = time.monotonic() - h.assigned_at
        h.info["latency_s"] = round(latency, 3)
        h.info["ok"] = outcome.ok
        h.info.setdefault("errors", [])
        if outcome.error:
            h.info["errors"].append(outcome.error)
        (self.waves.record_wave_latency if self.scheduler == "waves" else self.queue.record_latency)(latency)
        metrics()["wave_latency"].observe(
            latency, tags={"group": h.group.group_id, "outcome": "ok" if outcome.ok else "failed"})
        self.sink.on_finish(h.ticket, outcome, h.info)

    # -- failures ----------------------------------------------------------------------
    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for h in list(self._held.values()):
            if h.ticket.id in self._held and now > h.deadline and h.group.ready:
                why = f"request {h.ticket.id} exceeded its deadline of {h.info['deadline_s']:.0f}s"
                self._group_failed(h.group, why)

    def _group_failed(self, g: RankGroup, why: str) -> None:
        log.warning("group %s failed: %s", g.group_id, why)
        g.fail(why)
        for h in self._of(g):
            self._end(h, Outcome(g.first_bundle + h.rank, error=why))

    def _recover(self) -> None:
        """Rebuild broken groups on their own threads; fail the queue if nothing can serve."""
        for g in self.engine.groups:
            if g.state in (GroupState.BROKEN, GroupState.FAILED) and g.group_id not in self._rebuilding:
                if g.state is GroupState.FAILED and time.monotonic() - g.failed_at < self.retry_s:
                    continue
                self._rebuilding.add(g.group_id)
                threading.Thread(target=self._rebuild, args=(g,), daemon=True,
                                 name=f"rebuild-{g.group_id}").start()
        alive = [g for g in self.engine.groups
                 if g.state in (GroupState.READY, GroupState.STARTING, GroupState.REBUILDING,
                                GroupState.BROKEN, GroupState.NEW)]
        if alive:
            self._unavailable_since = None
            return
        # Every group failed to start or rebuild: queued requests would wait forever.
        if self._unavailable_since is None:
            self._unavailable_since = time.monotonic()
        errors = [g.last_error for g in self.engine.groups if g.last_error]
        why = f"no DP group available: {errors[0] if errors else 'engine down'}"
        with self._cv:
            self._fail_queue(why)

    def _rebuild(self, g: RankGroup) -> None:
        try:
            g.rebuild(g.last_error or g.state.value)
        finally:
            self._rebuilding.discard(g.group_id)
            with self._cv:
                self._cv.notify_all()

    def _fail_queue(self, why: str) -> None:
        info = {"scheduler": self.scheduler, "reason": "unavailable", "ids": []}
        tickets: list[Ticket] = []
        while (w := self.waves.next_wave(now=float("inf"))) is not None:
            tickets.extend(w.tickets)
        while (t := self.queue.pick([], now=float("inf"))) is not None:
            tickets.append(t)
        for t in tickets:
            self.sink.on_finish(t, Outcome(-1, error=why), info)

    def _fail_all(self, why: str) -> None:
        for h in list(self._held.values()):
            self._end(h, Outcome(h.group.first_bundle + h.rank, error=why))
        with self._cv:
            self._fail_queue(why)

    def _depth(self) -> None:
        for g in self.engine.groups:
            metrics()["queue_depth"].set(self.depth, tags={"group": g.group_id})
            metrics()["queue_capacity"].set(self.max_queue, tags={"group": g.group_id})
            g.refresh_gauges()
