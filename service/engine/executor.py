"""The seam between the dispatcher and whatever runs the ranks (vLLM's executor split).

The dispatcher sees ``Executor``: groups of scheduler ranks it can assign requests to, one
``poll`` that returns typed events, and ``rebuild``/``cancel``/``close``. It never sees Ray,
processes or tensors. Three executors implement it: Ray actors in a placement group
(``ray_executor``), local processes for ``dloserve generate`` (``local``) and an in-memory
fake for the scheduling tests (``tests/fakes.py``).

``GroupExecutor`` holds what the two real ones share: the group records and their states,
which jobs each group is still forwarding (a group ticks only while one is), the serve
rounds, and the rules that turn what a rank process said into events:

- in an SP group (S processes, one scheduler rank) process 0 speaks for the rank, and a
  request that fails on any process fails the group (the attention all-to-alls of the
  others are out of step and cannot be replayed);
- a process that died, was lost, or reported a sticky error fails its group: every job
  the group holds fails (in an AllGather group the other ranks' gathers cannot finish);
- anything said by an earlier generation of a group, or after it failed, is dropped.

A transport (subclass) only starts and kills processes, sends them calls, and hands back
their replies. Group starts and rebuilds run on threads the executor owns and joins.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from service.config import EngineConfig, ModeChoice, OffloadMode

from .events import Event, EventKind

log = logging.getLogger("dloserve.engine")


class GroupState(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    READY = "ready"
    BROKEN = "broken"  # a rank failed; waiting for a rebuild
    REBUILDING = "rebuilding"
    FAILED = "failed"  # the last start or rebuild attempt failed
    CLOSED = "closed"


@dataclass(frozen=True)
class GroupInfo:
    """One group as the dispatcher sees it."""

    id: str
    size: int  # scheduler ranks (requests it runs at once)
    first_rank: int  # index of its first rank process among the engine's (reports, metrics)
    collective: bool  # whether its ranks gather from each other (and so tick together)


class Executor(ABC):
    """Runs the rank groups behind one queue. Every call but ``status`` comes from the
    dispatcher's thread; ``status`` may come from any."""

    # What it runs. ``start`` resolves --dlo-mode auto once; from then on ``config.choice`` says
    # what the probe chose and why (None: the flags set the mode).
    config: EngineConfig

    @abstractmethod
    def start(self) -> None:
        """Place and begin starting every group; their READY / START_FAILED come by ``poll``.
        Raises only when nothing can start at all (placement, the auto probe)."""

    @abstractmethod
    def groups(self) -> list[GroupInfo]: ...

    @abstractmethod
    def state(self, group: str) -> GroupState: ...

    @abstractmethod
    def assign(self, group: str, rank: int, job_id: str, req: Any) -> None:
        """Give ``req`` to scheduler rank ``rank`` of a READY group."""

    @abstractmethod
    def cancel(self, group: str, rank: int, job_id: str) -> None:
        """Stop ``job_id`` at its next forward; its FINISHED (``cancelled``) comes by ``poll``."""

    @abstractmethod
    def poll(self, timeout: float) -> list[Event]:
        """What happened since the last call; waits up to ``timeout`` when nothing did."""

    @abstractmethod
    def fail(self, group: str, reason: str) -> None:
        """Take a group out of service (a missed deadline): nothing more goes to it."""

    @abstractmethod
    def rebuild(self, group: str) -> bool:
        """Begin one attempt to bring a BROKEN or FAILED group back (new processes); its
        READY or START_FAILED comes by ``poll``. False if an attempt is already running."""

    @abstractmethod
    def status(self) -> dict[str, Any]: ...

    @abstractmethod
    def close(self) -> None:
        """Stop everything; no process is started after this returns."""


@dataclass
class Group:
    """A group's record inside a real executor (transport state lives in the transport)."""

    info: GroupInfo
    sp: int
    state: GroupState = GroupState.NEW
    generation: int = 0
    rebuilds: int = 0
    last_error: str | None = None
    forwarding: dict[str, int] = field(default_factory=dict)  # job -> scheduler rank, forwards left
    serving: int = 0  # serve calls in flight (one per process per round)
    handles: list[Any] = field(default_factory=list)  # the transport's per-process handles
    started: dict[str, Any] = field(default_factory=dict)  # where the last start's time went

    @property
    def world(self) -> int:
        return self.info.size * self.sp

    def status(self, names: list[str]) -> dict[str, Any]:
        return {"group": self.info.id, "state": self.state.value, "generation": self.generation,
                "size": self.info.size, "first_rank": self.info.first_rank, "rebuilds": self.rebuilds,
                "last_error": self.last_error, "workers": names, "last_start": self.started}


@dataclass(frozen=True)
class Reply:
    """What one rank process said (or that it died), as a transport hands it back."""

    kind: str  # "events", "served", "refused" (an assign it refused), "failed" (its loop raised)
    # or "lost" (the process died or cannot be reached)
    events: tuple[Event, ...] = ()
    error: str = ""


class GroupExecutor(Executor):
    """The shared part of the real executors; a transport fills in the five hooks."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._lock = threading.RLock()
        self._groups: dict[str, Group] = {}
        self._pending: queue.SimpleQueue[Event] = queue.SimpleQueue()  # from start/rebuild threads
        self._threads: set[threading.Thread] = set()
        self._closed = False
        # Before the groups start (the transport's: when, placement, auto's probe) and when
        # each group was first ready: /readyz's ``startup`` (service.api.startup).
        self.startup: dict[str, float] = {}
        self.probes = 0  # auto probes this executor ran (a rule or the probe cache runs none)
        self._first_ready: dict[str, float] = {}

    # -- the transport's part ---------------------------------------------------------
    @abstractmethod
    def _open(self, g: Group) -> None:
        """Start ``g``'s processes and load them (blocking; raises on failure). Sets ``g.handles``."""

    @abstractmethod
    def _kill(self, g: Group) -> None:
        """Stop ``g``'s processes at once (they may be inside a collective) and forget them."""

    @abstractmethod
    def _send(self, g: Group, process: int, op: str, *args: Any) -> None:
        """Call ``op`` ("assign", "cancel", "serve") on process ``process`` of ``g``."""

    @abstractmethod
    def _replies(self, timeout: float) -> list[tuple[Group, int, int, Reply]]:
        """Replies from READY groups: (group, generation, process, reply); waits up to ``timeout``."""

    @abstractmethod
    def _names(self, g: Group) -> list[str]:
        """Names of ``g``'s processes (for status and operators)."""

    # -- auto -------------------------------------------------------------------------
    def _resolve_auto(self, run_probe: Callable[[], ModeChoice]) -> None:
        """``--dlo-mode auto``, once for the engine, before the groups are laid out: left to
        the rank where there is one group of one process (``EngineConfig.rank_decides_auto``,
        then ``_take_rank_choice``), else a rule where no probe can change the answer
        (``start.rule_mode``: CPU ranks, a family with no probe; here, no process), else an
        earlier start's timings for the same facts (``probe_cache``), else the transport runs
        ``start.probe_mode`` where a rank would (``run_probe``) and its timings are kept. The
        config carries the choice from then on (one AllGather group of N, or N rank-local
        ranks)."""
        if self.config.offload.mode is not OffloadMode.AUTO:
            return
        if self.config.rank_decides_auto:
            log.info("--dlo-mode auto: one group, laid out alike for either mode: its rank decides at load")
            return
        from . import probe_cache
        from .start import cached_mode, rule_mode

        try:
            choice = rule_mode(self.config)
            host = self._probe_host() if choice is None else None
            facts = probe_cache.probe_facts(self.config, *host) if host else None
            hit = probe_cache.lookup(facts) if facts else None
            if hit is not None:
                choice = cached_mode(self.config, *hit)
            if choice is None:
                choice = replace(run_probe(), source="probe")
                self.probes += 1
                if facts and choice.timings is not None:
                    probe_cache.store(facts, choice.timings)
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"--dlo-mode auto probe failed: {short(e)}") from e
        log.info("--dlo-mode auto chose %s (%s): %s", choice.mode.value, choice.source, choice.reason)
        self.config = self.config.resolved(choice)

    def _take_rank_choice(self, facts: list[dict[str, Any]]) -> None:
        """auto left to the rank (``EngineConfig.rank_decides_auto``): its choice, from the
        first group's load on, is the engine's (standbys and rebuilds load it; /readyz says it)."""
        choice = next((f["choice"] for f in facts if f.get("choice") is not None), None)
        with self._lock:
            if choice is not None and self.config.offload.mode is OffloadMode.AUTO:
                log.info("--dlo-mode auto: the rank chose %s (%s): %s", choice.mode.value, choice.source,
                         choice.reason)
                self.config = self.config.resolved(choice)

    def _probe_host(self) -> tuple[str, float] | None:
        """The GPU model a probe would run on and how many the node has (the probe cache's
        key); None: not known here, so nothing is cached."""
        return None

    # -- layout -----------------------------------------------------------------------
    def _lay_out(self) -> None:
        """Groups for the config's (resolved) mode."""
        with self._lock:
            self._groups = {}
            for first, size in self.config.group_layout():
                gid = uuid.uuid4().hex[:8]
                info = GroupInfo(gid, size, first, self.config.collective)
                self._groups[gid] = Group(info, self.config.parallel.sp_size)

    def _start_all(self) -> None:
        for g in list(self._groups.values()):
            self._spawn(g, rebuild=False)

    # -- Executor ---------------------------------------------------------------------
    def groups(self) -> list[GroupInfo]:
        with self._lock:
            return [g.info for g in self._groups.values()]

    def state(self, group: str) -> GroupState:
        with self._lock:
            return self._groups[group].state

    def assign(self, group: str, rank: int, job_id: str, req: Any) -> None:
        with self._lock:
            g = self._groups[group]
            if g.state is not GroupState.READY:
                raise RuntimeError(f"group {group} is {g.state.value}")
            g.forwarding[job_id] = rank
            for p in range(rank * g.sp, (rank + 1) * g.sp):
                self._send(g, p, "assign", job_id, req)

    def cancel(self, group: str, rank: int, job_id: str) -> None:
        with self._lock:
            g = self._groups[group]
            if g.state is GroupState.READY:
                for p in range(rank * g.sp, (rank + 1) * g.sp):
                    self._send(g, p, "cancel", job_id)

    def poll(self, timeout: float) -> list[Event]:
        out = self._drain_pending()
        with self._lock:
            for g in self._groups.values():
                if g.state is GroupState.READY and g.forwarding and not g.serving:
                    for p in range(g.world):
                        self._send(g, p, "serve")
                    g.serving = g.world
        for g, generation, process, reply in self._replies(0.0 if out else timeout):
            with self._lock:
                if g.generation != generation or g.state is not GroupState.READY:
                    continue  # said before a failure or a rebuild: nothing to act on
                out.extend(self._translate(g, process, reply))
        return out + self._drain_pending()

    def fail(self, group: str, reason: str) -> None:
        with self._lock:
            self._broken(self._groups[group], reason)

    def rebuild(self, group: str) -> bool:
        with self._lock:
            g = self._groups[group]
            if self._closed or g.state not in (GroupState.BROKEN, GroupState.FAILED):
                return False
            g.rebuilds += 1
        return self._spawn(g, rebuild=True)

    def status(self) -> dict[str, Any]:
        with self._lock:
            groups = [g.status(self._names(g)) for g in self._groups.values()]
            startup = {**self.startup, "groups_ready_at": dict(self._first_ready)}
        par = self.config.parallel
        return {"groups": groups, "dp_size": par.dp_size, "sp_size": par.sp_size,
                "startup": startup,
                "offload_mode": self.config.mode_report()}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for t in threads:
            t.join()
        with self._lock:
            for g in self._groups.values():
                self._kill(g)
                g.state = GroupState.CLOSED

    # -- internals --------------------------------------------------------------------
    def _spawn(self, g: Group, rebuild: bool) -> bool:
        """Start (or restart) ``g`` on a thread of ours; False if one is running already."""
        with self._lock:
            if self._closed or g.state in (GroupState.STARTING, GroupState.REBUILDING):
                return False
            g.state = GroupState.REBUILDING if rebuild else GroupState.STARTING
            t = threading.Thread(target=self._bring_up, args=(g, rebuild), daemon=True,
                                 name=f"{'rebuild' if rebuild else 'start'}-{g.info.id}")
            self._threads.add(t)
        t.start()
        return True

    def _bring_up(self, g: Group, rebuild: bool) -> None:
        try:
            with self._lock:
                self._kill(g)
                if rebuild:
                    g.generation += 1
            try:
                self._open(g)
                with self._lock:
                    if self._closed:
                        raise RuntimeError("executor closed while the group started")
                    g.forwarding.clear()
                    g.serving = 0
                    g.state = GroupState.READY  # last_error stays: what the last failure was (readyz, /ui)
                    self._first_ready.setdefault(g.info.id, time.time())
                self._pending.put(Event(EventKind.GROUP_READY, group=g.info.id))
            except Exception as e:  # noqa: BLE001 - any start failure leaves a clean, failed group
                why = f"group {'rebuild' if rebuild else 'start'} failed: {short(e)}"
                log.warning("group %s: %s", g.info.id, why)
                with self._lock:
                    self._kill(g)
                    g.state, g.last_error = GroupState.FAILED, why
                self._pending.put(Event(EventKind.START_FAILED, group=g.info.id, error=why))
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _drain_pending(self) -> list[Event]:
        out: list[Event] = []
        while True:
            try:
                out.append(self._pending.get_nowait())
            except queue.Empty:
                return out

    def _broken(self, g: Group, why: str) -> None:
        if g.state is not GroupState.READY:
            return
        g.state, g.last_error = GroupState.BROKEN, why
        g.forwarding.clear()
        g.serving = 0

    def _translate(self, g: Group, process: int, reply: Reply) -> list[Event]:
        """A rank process's reply as events for the dispatcher (the rules in the module doc)."""
        gid, rank, label = g.info.id, process // g.sp, g.info.first_rank + process
        if reply.kind in ("lost", "failed"):
            why = f"rank {label} {'died' if reply.kind == 'lost' else 'failed'}: {reply.error}"
            self._broken(g, why)
            return [Event(EventKind.GROUP_FAILED, group=gid, rank=rank, error=why)]
        if reply.kind == "served":
            g.serving = max(0, g.serving - 1)
            return []
        if reply.kind == "refused":
            if g.sp > 1:  # the other processes may hold it already and would wait for this one
                why = f"rank {label} failed: {reply.error}"
                self._broken(g, why)
                return [Event(EventKind.GROUP_FAILED, group=gid, rank=rank, error=why)]
            job = reply.events[0].job_id if reply.events else ""
            g.forwarding.pop(job, None)
            return [Event(EventKind.REFUSED, group=gid, rank=rank, job_id=job, error=reply.error)]
        out: list[Event] = []
        for ev in reply.events:
            if ev.kind is EventKind.RANK_FAILED or (g.sp > 1 and ev.kind is EventKind.FINISHED and ev.error
                                                    and not ev.cancelled):
                why = f"rank {label} failed: {ev.error}"
                self._broken(g, why)
                return [Event(EventKind.GROUP_FAILED, group=gid, rank=rank, error=why)]
            if ev.kind in (EventKind.FORWARDS_DONE, EventKind.FINISHED):
                g.forwarding.pop(ev.job_id, None)
            if process % g.sp == 0:  # SP: process 0 speaks for the rank
                out.append(replace(ev, group=gid, rank=rank))
        return out


def log_start(g: Group, facts: list[dict[str, Any]], stages: dict[str, float],
              detail: dict[str, float] | None = None, extra: dict[str, Any] | None = None) -> None:
    """Where a group's start went (kept for /readyz, and one log line): the transport's
    stages (they add up to ``seconds``), parts of them (``detail``, named ``stage.part``),
    then the slowest rank's (process group, load and its parts, encoders)."""
    slowest = max(facts, key=lambda f: f.get("setup_s", 0.0), default={})
    breakdown = {k: round(v, 3) for k, v in {**stages, **(detail or {}), **slowest.get("stages", {})}.items()}
    g.started = {"seconds": round(sum(stages.values()), 3), "stages": breakdown,
                 "encoders": [f.get("encoders") for f in facts], "compute": slowest.get("compute"),
                 **(extra or {})}
    parts = ", ".join(f"{k} {v:.2f} s" for k, v in breakdown.items())
    log.info("group %s gen %d ready in %.2f s (%s); ranks: %s; compute: %s", g.info.id, g.generation,
             sum(stages.values()), parts, [(f["rank"], f["pid"], f.get("setup_s")) for f in facts],
             slowest.get("compute"))


def short(e: BaseException, n: int = 300) -> str:
    """The last line of an error (Ray's carry a traceback), capped."""
    s = str(e).strip().splitlines()
    return (s[-1] if s else type(e).__name__)[:n]
