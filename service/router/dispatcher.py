"""The loop that feeds queued requests to an executor's rank groups and reports how they end.

One thread, shared by the HTTP ingress, the batch job and ``dloserve generate``, so all
three schedule the same way. It knows groups of ranks (``GroupInfo``) and typed events,
never Ray or processes: the executor behind it may be Ray actors, local processes or the
tests' fake, and the clock is injectable, so every rule below is unit-tested in
milliseconds.

- Every accepted request ends: completed, cancelled, or failed with a reason.
- A rank group that fails (a rank died, a sticky error, a missed deadline) takes exactly the
  requests it held; in an AllGather group that is every rank's request (their gathers
  cannot finish), in rank-local mode only the dead rank's. They go back to the queue,
  ahead of later arrivals (the outputs are a function of the request: a rerun gives the
  same bytes), except the suspect: the request whose deadline passed, or the one on the
  rank that raised a device or collective error, fails; the one on a rank whose process
  died reruns up to ``job_retries`` times. The others on the group only stood by; they
  rerun whatever the count, bounded by ``max_queue_wait_s`` (``job_retries`` 0: none does).
- A resumable request's rank hands its state off after each step (STEP events with a
  ``state``, engine/state.py); the dispatcher keeps the last one of each request it holds,
  in memory, while it holds it or has queued it again. A rerun goes on from that step
  (models/resume.py) and says so: ``resumed_from_step`` in what the sink's ``on_start`` gets.
- Priorities: a queued request of a better (lower) priority than
  one a rank forwards pauses that one at its next forward (``preempt``: queued again with
  its state, not a rerun), at most ``max_preemptions`` times per request (router/priority.py).
  Under waves a whole wave is paused, its group freeing only when all of it ends.
- Queued requests wait for a group to come back, each up to ``max_queue_wait_s``.
- A failed start or rebuild is tried again at once, then with capped backoff, for as long
  as the dispatcher runs (or ``max_attempts`` in a row, for one-shot front ends).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from service.config import ModeChoice, SchedulerConfig
from service.engine.batching import batch_cap, batch_key
from service.engine.events import Event, EventKind
from service.engine.executor import Executor, GroupInfo, GroupState
from service.engine.metrics import metrics
from service.engine.outcome import Outcome
from service.router.health import Availability, Track, Unavailable, backoff_s, failure_kind
from service.router.policy import DeadlinePolicy
from service.router.priority import DEFAULT_MAX_PREEMPTIONS, Running, victims, wave_victims
from service.router.queue import Ticket
from service.router.scheduler import Pick, Scheduler

log = logging.getLogger("dloserve.router")


class Sink(Protocol):
    """Where job state goes (the HTTP job store, the batch manifest, generate's file)."""

    def on_start(self, ticket: Ticket, info: dict[str, Any]) -> None: ...

    def on_progress(self, ticket_id: str, step: int, total: int) -> None: ...

    def on_finish(self, ticket: Ticket, outcome: Outcome, info: dict[str, Any]) -> None: ...

    def on_requeue(self, ticket: Ticket, why: str) -> None: ...


@dataclass
class Held:
    """A request a rank holds, from assignment until its MP4 (or error) comes back."""

    ticket: Ticket
    group: GroupInfo
    rank: int
    assigned_at: float
    deadline: float
    info: dict[str, Any]
    forwarding: bool = True  # False once its last forward ran (decode/encode remain)
    cancelled: bool = False
    paused: bool = False  # preempt(): it stops at its next forward and is queued again


def priority_of(req: Any) -> int:
    """A request's priority (lower first; a payload without one: 0)."""
    return int(getattr(req, "priority", 0) or 0)


def request_cost(req: Any) -> float:
    """Relative cost of one forward: pixels x frames (tokens, up to the model's constant)."""
    return float(req.width * req.height * req.num_frames)


@dataclass
class Dispatcher:
    """Owns the queue and drives the executor; ``submit`` from any thread, the rest on one."""

    executor: Executor
    sink: Sink
    scheduler: Scheduler
    deadlines: DeadlinePolicy = field(default_factory=DeadlinePolicy)
    max_queue_wait_s: float = SchedulerConfig.max_queue_wait_s
    max_attempts: int | None = None  # failed attempts in a row before giving up (None: never)
    # reruns of the request on a rank whose process died (0: none reruns)
    job_retries: int = SchedulerConfig.job_retries
    max_preemptions: int = DEFAULT_MAX_PREEMPTIONS  # pauses per request for better priorities (0: none)
    clock: Callable[[], float] = time.monotonic
    history: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=256))
    assignments: int = 0
    _cv: threading.Condition = field(default_factory=threading.Condition)
    _stop: bool = False
    _keep: bool = False  # stop(fail=False): held and queued requests are left as they are
    _thread: threading.Thread | None = None
    _held: dict[str, Held] = field(default_factory=dict)
    _states: dict[str, Any] = field(default_factory=dict)  # job -> its last StepState (held or requeued)
    _tracks: dict[str, Track] = field(default_factory=dict)
    _cancel_list: list[str] = field(default_factory=list)  # running jobs to cancel (loop thread sends)
    _engine_error: str | None = None
    _opened: bool = False  # open() ran: the executor's groups are known
    _start_s: float = 30.0  # how long a start took last time (Retry-After while down)
    _unavailable_since: float | None = None
    gave_up: str | None = None  # max_attempts reached: why (every job then fails)
    attempts: dict[str, int] = field(default_factory=lambda: {"ready": 0, "failed": 0})  # group starts

    # -- any thread --------------------------------------------------------------------
    def start(self) -> None:
        """Start the executor and the loop thread."""
        self._thread = threading.Thread(target=self._main, name="dloserve-dispatch", daemon=True)
        self._thread.start()

    def open(self) -> None:
        """Start the executor's groups (their READY/START_FAILED arrive as events)."""
        t0 = self.clock()
        try:
            self.executor.start()
        except Exception as e:  # noqa: BLE001 - requests fail with the reason, the loop lives
            log.exception("engine failed to start")
            self._engine_error = str(e)
        with self._cv:
            for info in self.executor.groups():
                self._tracks[info.id] = Track(info, attempt_started=t0)
            self._opened = True
        if not self._tracks:
            self._unavailable_since = t0
            if self.max_attempts is not None:
                self.gave_up = f"engine failed to start: {self._engine_error}"

    def stop(self, timeout: float = 30.0, fail: bool = True) -> None:
        """Stop the loop and the executor. ``fail``: every held and queued request ends
        "service stopped" (a drain's end); without it none ends here: their records stay
        unfinished for whoever keeps them (the job store takes a silent group's jobs back)."""
        with self._cv:
            self._stop, self._keep = True, not fail
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        elif fail:
            self._fail_all("service stopped")
        self.executor.close()

    def submit(self, ticket_id: str, key: str, payload: Any, tenant: str | None = None) -> Ticket:
        """Queue one validated request of ``tenant`` (an API key's owner id); QuotaExceeded
        when that tenant's own queue is full, QueueFull when the whole queue is, Unavailable
        when no group can serve and none is about to."""
        with self._cv:
            availability, why = self._availability()
            if availability is Availability.DOWN:
                raise Unavailable(why, self._retry_after_down())
            t = self.scheduler.submit(ticket_id, key, payload, request_cost(payload), self.clock(), tenant,
                                      priority_of(payload))
            self._depth()
            self._cv.notify_all()
            return t

    def admit(self, tenant: str | None) -> None:
        """What ``submit`` would refuse (Unavailable, QuotaExceeded, QueueFull), asked before
        the work of reading a request (its image) is done; ``submit`` asks again."""
        with self._cv:
            availability, why = self._availability()
            if availability is Availability.DOWN:
                raise Unavailable(why, self._retry_after_down())
            self.scheduler.admit(tenant)

    def adopt(self, ticket_id: str, key: str, payload: Any, tenant: str | None = None) -> bool:
        """Queue a request that a lost group held (another replica's), past the bounds and
        quotas: it was admitted once. This is its rerun (``reruns`` 1). A payload resumed from
        a kept state (after a restart) goes on from it. False if this dispatcher has it
        already (its own group was only silent, not gone)."""
        with self._cv:
            if ticket_id in self._held or self.scheduler.has(ticket_id):
                return False
            state = getattr(payload, "resume", None)
            if state is not None:  # kept like a state its rank handed off here
                self._states[ticket_id] = state
                payload = payload.resumed(None)
            t = Ticket(ticket_id, key, payload, self.clock(), request_cost(payload), tenant, reruns=1,
                       requeues=1, priority=priority_of(payload), requeued_for="adopted")
            self.scheduler.requeue(t)
            self._depth()
            self._cv.notify_all()
            return True

    def cancel(self, ticket_id: str) -> str:
        """'queued' (dropped now), 'running' (stops at its next forward), or 'missing'."""
        with self._cv:
            if self.scheduler.cancel(ticket_id):
                self._states.pop(ticket_id, None)
                self._depth()
                return "queued"
            h = self._held.get(ticket_id)
            if h is None:
                return "missing"
            h.cancelled = True
            self._cancel_list.append(ticket_id)
            self._cv.notify_all()
        return "running"

    def preempt(self, ticket_id: str) -> bool:
        """Pause a running request at its next forward and queue it again, to go on later
        from its last kept step (the same state a rerun after a rank death uses; not counted
        as a rerun). False if it is not running, is being cancelled, has run its last
        forward, or has no state kept (it would lose its work: not resumable, or no step
        done yet). Priorities call it (``_preempt_for_queue``)."""
        with self._cv:
            h = self._held.get(ticket_id)
            if h is None or h.cancelled or h.paused or not h.forwarding or ticket_id not in self._states:
                return False
            h.paused = True
            self._cancel_list.append(ticket_id)
            self._cv.notify_all()
        return True

    @property
    def depth(self) -> int:
        return self.scheduler.depth

    @property
    def choice(self) -> ModeChoice | None:
        """What ``--dlo-mode auto`` chose for this engine and why (None: the flags set the mode)."""
        return self.executor.config.choice

    @property
    def held(self) -> int:
        return len(self._held)

    def counts(self, tenant: str | None) -> dict[str, int]:
        """One tenant's own requests here: queued, and held by a rank."""
        with self._cv:
            return self.scheduler.counts(tenant)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def unavailable_since(self) -> float | None:
        """Since when no group has been ready (None while one is)."""
        return self._unavailable_since

    def availability(self) -> tuple[Availability, str]:
        with self._cv:
            return self._availability()

    def fail_queued(self, why: str) -> int:
        """End every queued request as failed with ``why`` (a drain); returns how many."""
        with self._cv:
            return self._fail_queue(why)

    def status(self) -> dict[str, Any]:
        """The engine as operators see it: one state word, the groups, why it is not ready."""
        st = self.executor.status()
        states = [GroupState(g["state"]) for g in st["groups"]]
        ready = sum(s is GroupState.READY for s in states)
        availability, why = self.availability()
        if states and ready == len(states):
            state = "ready"
        elif ready:
            state = "degraded"  # some ranks serve, others rebuild
        elif availability is Availability.DOWN:
            state = "down"
        else:
            order = ["rebuilding", "starting", "broken", "failed", "new", "closed"]
            state = min((s.value for s in states), key=order.index) if states else "down"
        errors = [g["last_error"] for g in st["groups"] if g["last_error"] and g["state"] != "ready"]
        return {**st, "state": state, "availability": availability.value,
                "last_error": errors[0] if errors else (self._engine_error or (why or None)),
                "start_attempts": dict(self.attempts),
                "generation": sum(g["generation"] for g in st["groups"]),
                "rebuilds": sum(g["rebuilds"] for g in st["groups"]),
                "workers": [w for g in st["groups"] for w in g["workers"]]}

    # -- the loop ----------------------------------------------------------------------
    def _main(self) -> None:
        self.open()
        while True:
            with self._cv:
                if self._stop:
                    if not self._keep:
                        self._fail_all("service stopped")
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - never let the loop die with requests in hand
                log.exception("dispatcher step crashed")
                self._fail_all(f"internal error: {e}")
                time.sleep(0.5)

    def step(self, timeout: float = 0.05) -> None:
        """One round: retries due, assignments, events, deadlines (the tests call it directly)."""
        now = self.clock()
        self._retry_due(now)
        self._send_cancels()
        with self._cv:
            self._assign(now)
            self._preempt_for_queue()
            self._expire_queue(now)
            self._depth()
        for ev in self.executor.poll(min(timeout, self.scheduler.wake_in(now))):
            self._on_event(ev)
        self._check_deadlines(self.clock())

    # -- assignment --------------------------------------------------------------------
    def _of(self, gid: str) -> list[Held]:
        return [h for h in self._held.values() if h.group.id == gid]

    def _assign(self, now: float) -> None:
        if self.gave_up:
            self._fail_queue(self.gave_up)
            return
        for tr in self._tracks.values():
            if not tr.ready:
                continue
            running = {h.rank: h.ticket for h in self._of(tr.info.id) if h.forwarding}
            waves: dict[int, int] = {}  # picks that share their info are one wave: one number
            for pick in self.scheduler.take(tr.info.size, running, now):
                if id(pick.info) not in waves:
                    waves[id(pick.info)] = self.assignments
                    self.assignments += 1
                self._give(tr.info, pick, now, waves[id(pick.info)])
            self._join_batches(tr.info, now)

    def _batch(self, payload: Any) -> tuple[str | None, int]:
        """(batch key, cap) of a request on this executor's ranks (None, 1: it runs alone)."""
        config = getattr(self.executor, "config", None)
        if config is None or not hasattr(payload, "loras"):
            return None, 1
        return batch_key(payload, config), batch_cap(payload, config)

    def _join_batches(self, g: GroupInfo, now: float) -> None:
        """Queued requests of a running batch's key join it, up to its cap (engine/batching.py)."""
        ranks: dict[int, list[Held]] = {}
        for h in self._of(g.id):
            if h.forwarding and not h.cancelled and not h.paused:
                ranks.setdefault(h.rank, []).append(h)
        for rank, held in ranks.items():
            key, cap = self._batch(held[0].ticket.payload)
            while key is not None and len(held) < cap:
                t = self.scheduler.join(lambda x, k=key: self._batch(x.payload)[0] == k, now)
                if t is None:
                    break
                info = {"scheduler": self.scheduler.name, "key": t.key, "size": len(held) + 1,
                        "reason": "batch"}
                self._give(g, Pick(rank, t, info, tuple(h.ticket.payload for h in held) + (t.payload,)), now,
                           self.assignments)
                self.assignments += 1
                if t.id in self._held:
                    held.append(self._held[t.id])

    def _give(self, g: GroupInfo, pick: Pick, now: float, wave: int) -> None:
        t = pick.ticket
        deadline = self.deadlines.deadline_s(list(pick.alongside))
        state = self._states.get(t.id)
        rec = {**pick.info, "wave": wave, "ids": [t.id], "tenant": t.tenant, "group": g.id,
               "rank": g.first_rank + pick.rank, "deadline_s": round(deadline, 1), "started_at": time.time(),
               "queued_s": round(now - t.enqueued_at, 3), "resumed_from_step": state.step if state else 0}
        self.history.append(rec)
        self._held[t.id] = Held(t, g, pick.rank, now, now + deadline, rec)
        metrics()["wave_size"].observe(pick.info["size"], tags={"group": g.id})
        metrics()["assignments"].inc(1, tags={"scheduler": pick.info["scheduler"],
                                              "reason": pick.info["reason"]})
        self.sink.on_start(t, rec)
        if state is not None:  # it goes on from its step: after a pause, a rerun or a takeover
            metrics()["resumes"].inc(1, tags={"group": g.id, "cause": t.requeued_for or "rerun"})
        payload = t.payload if state is None else t.payload.resumed(state)
        try:
            self.executor.assign(g.id, pick.rank, t.id, payload)
        except RuntimeError as e:  # the group failed between the check and the call
            why = f"rank group unavailable: {e}"
            h = self._held[t.id]
            if not self._requeue(h, why, counted=False):  # it never ran
                self._end(h, Outcome(g.first_rank + pick.rank, error=why))

    def _preempt_for_queue(self) -> None:
        """Pause the running requests that better-priority queued ones should displace
        (router/priority.py; the caller holds _cv): single requests under continuous
        scheduling, a whole wave under waves (its group frees only when all of it ends)."""
        if self.max_preemptions < 1 or not self.scheduler.depth:
            return
        tenants = self.scheduler.tenants
        waiting = [t.priority for t in self.scheduler.queued()
                   if not self.scheduler.fair or tenants.may_run(t.tenant)]
        if not waiting:
            return
        pausing = sum(h.paused and h.forwarding for h in self._held.values())  # ranks about to free

        def running(h: Held) -> Running | None:  # None: it cannot be paused (no state kept, ...)
            if h.cancelled or h.paused or h.ticket.id not in self._states:
                return None
            return Running(h.ticket.id, h.ticket.priority, h.ticket.preemptions, h.assigned_at)

        if self.scheduler.name == "waves":
            busy = {gid: [running(h) for h in self._of(gid) if h.forwarding]
                    for gid, tr in self._tracks.items() if tr.ready}
            if not all(busy.values()):
                return  # a free group takes the next wave without a pause
            jobs = wave_victims(waiting, busy.values(), pausing, self.max_preemptions)
        else:
            held = [h for h in self._held.values() if h.forwarding and self._tracks[h.group.id].ready]
            jobs = victims(waiting, [r for h in held if (r := running(h))], pausing, self.max_preemptions)
        for job in jobs:
            if self.preempt(job):
                log.info("%s paused for a better-priority request", job)

    def _send_cancels(self) -> None:
        with self._cv:
            ids, self._cancel_list = self._cancel_list, []
        for i in ids:
            h = self._held.get(i)
            if h is not None:
                self.executor.cancel(h.group.id, h.rank, i)

    # -- events ------------------------------------------------------------------------
    def _on_event(self, ev: Event) -> None:
        kind = ev.kind
        if kind is EventKind.GROUP_READY:
            self._group_ready(ev.group)
            return
        if kind is EventKind.START_FAILED:
            self._start_failed(ev.group, ev.error or "start failed")
            return
        if kind is EventKind.GROUP_FAILED:
            self._group_failed(ev.group, ev.error or "rank group failed", rank=ev.rank)
            return
        h = self._held.get(ev.job_id)
        if h is None or h.group.id != ev.group:
            return
        if kind is EventKind.STEP and (ev.state is not None or ev.preview is not None):
            # a state or a preview: the step's progress came on its own STEP
            kept = self._states.get(h.ticket.id)
            if ev.state is not None and (kept is None or ev.state.step > kept.step):
                self._states[h.ticket.id] = ev.state  # (a GPU copy may land after the next step's)
                on_state = getattr(self.sink, "on_state", None)  # a sink that keeps it durably (the API)
                if on_state is not None:
                    on_state(h.ticket.id, ev.state)
            on_preview = getattr(self.sink, "on_preview", None)  # a sink that shows previews (the API)
            if ev.preview is not None and on_preview is not None:
                on_preview(h.ticket.id, ev.step, ev.total, ev.preview)
        elif kind is EventKind.STEP:
            self.sink.on_progress(h.ticket.id, ev.step, ev.total)
        elif kind is EventKind.STARTED and ev.not_resumable:
            on_not_resumable = getattr(self.sink, "on_not_resumable", None)  # a sink that shows it (the API)
            if on_not_resumable is not None:
                on_not_resumable(h.ticket.id, ev.not_resumable)
        elif kind is EventKind.FORWARDS_DONE:
            h.forwarding = False
            with self._cv:
                self._cv.notify_all()
        elif kind is EventKind.FINISHED:
            if h.paused and ev.cancelled and not h.cancelled:  # stopped by preempt(): it goes on later
                self._requeue(h, "preempted: paused at a forward boundary", counted=False)  # never refused
                return
            cancelled = ev.cancelled or h.cancelled
            self._end(h, Outcome(h.group.first_rank + h.rank, None if cancelled else ev.mp4,
                                 "cancelled" if cancelled else ev.error, ev.seconds, cancelled=cancelled,
                                 timings={**ev.timings, "step_s": list(ev.step_s)}))
        elif kind is EventKind.REFUSED:
            self._end(h, Outcome(h.group.first_rank + h.rank, error=f"rank refused: {ev.error}"))

    def _end(self, h: Held, outcome: Outcome) -> None:
        self._states.pop(h.ticket.id, None)
        if self._held.pop(h.ticket.id, None) is not None:
            with self._cv:
                self.scheduler.finished(h.ticket)
        latency = self.clock() - h.assigned_at
        h.info["latency_s"] = round(latency, 3)
        h.info["ok"] = outcome.ok
        h.info.setdefault("errors", [])
        if outcome.error:
            h.info["errors"].append(outcome.error)
        outcome.timings.setdefault("queue_s", h.info["queued_s"])
        self.scheduler.record_latency(latency)
        metrics()["wave_latency"].observe(
            latency, tags={"group": h.group.id, "outcome": "ok" if outcome.ok else "failed"})
        self.sink.on_finish(h.ticket, outcome, h.info)

    # -- groups: failures and retries --------------------------------------------------
    def _group_ready(self, gid: str) -> None:
        metrics()["rebuild_attempts"].inc(1, tags={"outcome": "ready"})
        self.attempts["ready"] += 1
        tr = self._tracks[gid]
        now = self.clock()
        self._start_s = max(1.0, now - tr.attempt_started)
        tr.ready, tr.failures, tr.retry_at, tr.attempting, tr.last_error = True, 0, None, False, None
        self._unavailable_since = None
        metrics()["group_ready"].set(1, tags={"group": gid})
        with self._cv:
            self._cv.notify_all()

    def _start_failed(self, gid: str, why: str) -> None:
        metrics()["rebuild_attempts"].inc(1, tags={"outcome": "failed"})
        self.attempts["failed"] += 1
        tr = self._tracks[gid]
        tr.ready, tr.attempting, tr.last_error = False, False, why
        tr.failures += 1
        tr.retry_at = self.clock() + backoff_s(tr.failures)
        log.warning("group %s: attempt %d failed (%s); next in %.1f s", gid, tr.failures, why,
                    tr.retry_at - self.clock())
        self._note_unavailable()
        if self.max_attempts is not None and all(t.failures >= self.max_attempts and not t.ready
                                                 for t in self._tracks.values()):
            self.gave_up = f"no rank group could start ({tr.failures} attempts): {why}"
            with self._cv:
                self._fail_queue(self.gave_up)

    def _group_failed(self, gid: str, why: str, late: str | None = None, rank: int | None = None) -> None:
        """``gid`` cannot serve, and is rebuilt; its held requests stop. The suspect (``late``,
        which missed its deadline, else the one on ``rank``, which died or failed) fails with
        its own reason, or reruns if its rank's process died and it has reruns left; the
        others rerun (their reasons, if they fail, name no other request)."""
        log.warning("group %s failed: %s", gid, why)
        tr = self._tracks[gid]
        tr.ready, tr.last_error, tr.retry_at = False, why, self.clock()
        metrics()["group_ready"].set(0, tags={"group": gid})
        metrics()["rebuilds"].inc(1, tags={"group": gid, "reason": failure_kind(why)})
        died = failure_kind(why) in ("rank_died", "lost", "peer_lost")  # a process is gone
        for h in self._of(gid):
            if late is None:
                reason = why
            elif h.ticket.id == late:
                reason = f"exceeded its deadline of {h.info['deadline_s']:.0f}s"
            else:
                reason = "its rank group was rebuilt: another request on it exceeded its deadline"
            suspect = h.ticket.id == late if late is not None else rank is None or h.rank == rank
            if (died or not suspect) and self._requeue(h, reason, counted=suspect):
                continue
            if h.ticket.requeues:
                reason = f"{reason} (its rank group failed under it {h.ticket.requeues + 1} times)"
            self._end(h, Outcome(h.group.first_rank + h.rank, error=reason))
        self._note_unavailable()

    def _requeue(self, h: Held, why: str, counted: bool = True) -> bool:
        """Queue a held request again, unless it was cancelled or reruns are off; ``counted``
        (the suspect of a death): only while it has reruns left, and it uses one. A paused
        request (``preempt``) always goes back: it failed nothing."""
        t = h.ticket
        if (h.cancelled or (not self.job_retries and not h.paused)
                or (counted and t.reruns >= self.job_retries) or self._held.pop(t.id, None) is None):
            return False
        t.reruns += counted
        t.requeues += not h.paused
        t.preemptions += h.paused
        t.requeued_for = "preempted" if h.paused else "rerun"
        with self._cv:
            self.scheduler.finished(t)
            self.scheduler.requeue(t)
            self._cv.notify_all()
        h.info.update(ok=False, requeued=True, errors=[*h.info.get("errors", []), why])
        log.info("%s queued again (%s): %s", t.id, "paused" if h.paused else
                 f"rerun {t.reruns} of {self.job_retries}" if counted else "it stood by", why)
        metrics()["requeued"].inc(1, tags={"reason": "preempted" if h.paused else failure_kind(why)})
        if h.paused:
            metrics()["preemptions"].inc(1, tags={"group": h.group.id})
        self.sink.on_requeue(t, why)
        return True

    def _retry_due(self, now: float) -> None:
        for tr in self._tracks.values():
            if tr.ready or tr.attempting or tr.retry_at is None or tr.retry_at > now or self.gave_up:
                continue
            if self.executor.rebuild(tr.info.id):
                tr.attempting, tr.retry_at, tr.attempt_started = True, None, now

    def _check_deadlines(self, now: float) -> None:
        for h in list(self._held.values()):
            if h.ticket.id in self._held and now > h.deadline and self._tracks[h.group.id].ready:
                gid = h.group.id
                self.executor.fail(gid, f"a request exceeded its deadline of {h.info['deadline_s']:.0f}s")
                self._group_failed(gid, "a request exceeded its deadline", late=h.ticket.id)

    def _expire_queue(self, now: float) -> None:
        """Queued requests that waited ``max_queue_wait_s`` end failed (the caller holds _cv)."""
        for t in self.scheduler.queued():
            waited = now - t.enqueued_at
            if waited >= self.max_queue_wait_s and self.scheduler.cancel(t.id):
                self._states.pop(t.id, None)
                why = self._availability()[1] or "no rank was free"
                self.sink.on_finish(t, Outcome(-1, error=f"waited {waited:.0f} s in the queue, the limit "
                                               f"(--max-queue-wait-s); {why}"),
                                    {"scheduler": self.scheduler.name, "reason": "queue_wait", "ids": []})

    def _note_unavailable(self) -> None:
        if not any(t.ready for t in self._tracks.values()) and self._unavailable_since is None:
            self._unavailable_since = self.clock()

    def _availability(self) -> tuple[Availability, str]:
        """(availability, why); the caller holds _cv or accepts a racy read."""
        if self.gave_up:
            return Availability.DOWN, self.gave_up
        if not self._opened:
            return Availability.RECOVERING, "engine starting"
        tracks = list(self._tracks.values())
        if any(t.ready for t in tracks):
            return Availability.SERVING, ""
        errors = [t.last_error for t in tracks if t.last_error] or [self._engine_error or "engine starting"]
        if not tracks or all(t.failures >= 2 for t in tracks):
            return Availability.DOWN, f"no rank group can serve: {errors[0]}"
        return Availability.RECOVERING, f"no rank group is ready yet: {errors[0]}"

    def _retry_after_down(self) -> int:
        now = self.clock()
        due = [max(0.0, t.retry_at - now) for t in self._tracks.values() if t.retry_at is not None]
        return max(1, math.ceil(min(due, default=0.0) + self._start_s))

    def _fail_queue(self, why: str) -> int:
        """Fail every queued request (the caller holds _cv); returns how many."""
        info = {"scheduler": self.scheduler.name, "reason": "unavailable", "ids": []}
        tickets = self.scheduler.queued()
        for t in tickets:
            self.scheduler.cancel(t.id)
            self._states.pop(t.id, None)
            self.sink.on_finish(t, Outcome(-1, error=why), info)
        return len(tickets)

    def _fail_all(self, why: str) -> None:
        for h in list(self._held.values()):
            self._end(h, Outcome(h.group.first_rank + h.rank, error=why))
        with self._cv:
            self._fail_queue(why)

    def _depth(self) -> None:
        now = self._availability()[0]
        for a in Availability:
            metrics()["availability"].set(1 if a is now else 0, tags={"state": a.value})
        for gid, tr in self._tracks.items():  # gauges are re-set every step, or Ray drops them
            metrics()["group_ready"].set(1 if tr.ready else 0, tags={"group": gid})
            metrics()["queue_depth"].set(self.depth, tags={"group": gid})
            metrics()["queue_capacity"].set(self.scheduler.max_queue, tags={"group": gid})
