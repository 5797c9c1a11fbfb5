"""Groups of rank actors in a placement group, as the driver (dispatcher) sees them.

A ``RankGroup`` is N actors that tick together: an AllGather DP group (N ranks, one
torch.distributed group), or a single rank that makes no collectives (a rank-local or
resident rank: each one is its own group, so one that dies takes only itself down), or a
sequence-parallel group: S actors that are one rank to the scheduler (``size`` 1), all
running the same request; D of them serve D requests at once, independently. An
``Engine`` is the set of groups behind one queue and owns their placement group.

Lifecycle of a group: start (actors, rendezvous, load) -> ready -> ... -> on a dead rank, a
rank error or a missed deadline it is marked broken -> rebuild (kill its actors, new
actors, new process group on a new port). Nothing waits without a timeout: set-up has
one, requests have deadlines (enforced by the dispatcher), the process group has one.

The driver never touches tensors: it assigns requests, starts ``serve`` on every rank
when some rank has forwards to run, and collects events from one long poll per rank.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from service.engine.metrics import metrics
from service.engine.spec import EngineSpec, Outcome
from service.engine.worker import DPWorkerActor, ProbeTask, WorkerSpec

log = logging.getLogger("dloserve.engine")
NAMESPACE = "dloserve"
__all__ = ["Engine", "EngineSpec", "GroupFailure", "GroupState", "Outcome", "RankGroup"]


class GroupState(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    READY = "ready"
    BROKEN = "broken"
    REBUILDING = "rebuilding"
    FAILED = "failed"
    CLOSED = "closed"


class GroupFailure(Exception):
    """A rank died, failed or was lost: every request the group holds fails with this."""


@dataclass
class RankGroup:
    """Actors of one group; the dispatcher thread drives it, status reads may come from any."""

    spec: EngineSpec
    first_bundle: int
    size: int
    pg: PlacementGroup | None = None
    group_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    state: GroupState = GroupState.NEW
    generation: int = 0
    last_error: str | None = None
    rebuilds: int = 0
    failed_at: float = 0.0  # monotonic time of the last failed start or rebuild
    actors: list[Any] = field(default_factory=list)
    _refs: dict[Any, tuple[str, int]] = field(default_factory=dict)  # ref -> (kind, rank)
    _serving: int = 0  # serve calls in flight
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def sp(self) -> int:
        return self.spec.sp_size

    @property
    def world(self) -> int:
        """Actors (processes) in the group: ``size`` scheduler ranks of ``sp`` actors each."""
        return self.size * self.sp

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Create actors in the placement group, rendezvous, load; raises on failure."""
        assert self.pg is not None, "the engine places groups"
        self.state = GroupState.STARTING if self.generation == 0 else GroupState.REBUILDING
        self._gauge(0)
        wspec = WorkerSpec(
            model_dir=self.spec.model_dir,
            world=self.world,
            device=self.spec.device,
            offload=self.spec.offload,
            use_allgather=self.spec.use_allgather,
            offload_options=self.spec.offload_options,
            pg_timeout_s=self.spec.pg_timeout_s,
            group_id=self.group_id,
            rank_offset=self.first_bundle,
            encoders=self.spec.encoders_per_rank,
            sp_size=self.sp,
        )
        actors: list[Any] = []
        try:
            for r in range(self.world):
                strat = PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=self.first_bundle + r)
                actors.append(
                    DPWorkerActor.options(
                        name=self.actor_name(r),
                        namespace=NAMESPACE,
                        num_cpus=self.spec.cpus_per_rank,
                        num_gpus=self.spec.gpus_per_rank,
                        scheduling_strategy=strat,
                        max_restarts=0,
                    ).remote(r, wspec)
                )
            self.actors = actors
            timeout = self.spec.setup_timeout_s
            addr = ray.get(actors[0].rendezvous_address.remote(), timeout=timeout)
            facts = ray.get([a.setup.remote(addr) for a in actors], timeout=timeout)
        except Exception as e:  # noqa: BLE001 - any start failure leaves a clean, failed group
            self.last_error = f"group start failed: {_short(e)}"
            self._kill()
            self.state = GroupState.FAILED
            self.failed_at = time.monotonic()
            raise RuntimeError(self.last_error) from e
        log.info("group %s gen %d ready: %s", self.group_id, self.generation, facts)
        with self._lock:
            self._refs = {}
            self._serving = 0
            for r in range(self.world):
                self._poll(r)
        self.state = GroupState.READY
        self._gauge(1)

    def rebuild(self, reason: str, attempts: int = 3) -> bool:
        """Tear down and start again on new actors; True once ready."""
        metrics()["rebuilds"].inc(1, tags={"group": self.group_id, "reason": reason[:40]})
        self.rebuilds += 1
        for i in range(attempts):
            self._kill()
            self.generation += 1
            self.state = GroupState.REBUILDING
            try:
                self.start()
                return True
            except RuntimeError:
                log.exception("rebuild attempt %d of group %s failed", i + 1, self.group_id)
                time.sleep(min(5.0, 0.5 * 2**i))
        self.state = GroupState.FAILED
        self.failed_at = time.monotonic()
        return False

    def close(self) -> None:
        self._kill()
        self.state = GroupState.CLOSED
        self._gauge(0)

    def actor_name(self, rank: int) -> str:
        return f"dloserve-{self.group_id}-gen{self.generation}-rank{rank}"

    def status(self) -> dict[str, Any]:
        return {
            "group": self.group_id,
            "state": self.state.value,
            "generation": self.generation,
            "size": self.size,
            "first_rank": self.first_bundle,
            "rebuilds": self.rebuilds,
            "last_error": self.last_error,
            "workers": [self.actor_name(r) for r in range(len(self.actors))],
        }

    # -- driving -----------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.state is GroupState.READY

    @property
    def serving(self) -> bool:
        return self._serving > 0

    def assign(self, rank: int, job_id: str, req: Any) -> None:
        """Give ``req`` to scheduler rank ``rank`` (all S actors of it, in an SP group)."""
        with self._lock:
            for a in range(rank * self.sp, (rank + 1) * self.sp):
                self._refs[self.actors[a].assign.remote(job_id, req)] = ("assign", a)

    def serve(self) -> None:
        """Start one round of ticks on every rank (they return together when all are idle)."""
        with self._lock:
            for r, a in enumerate(self.actors):
                self._refs[a.serve.remote()] = ("serve", r)
            self._serving = self.world

    def refs(self) -> list[Any]:
        with self._lock:
            return list(self._refs)

    def owns(self, ref: Any) -> bool:
        return ref in self._refs

    def take(self, ref: Any) -> list[dict[str, Any]]:
        """Events from a finished call; GroupFailure if a rank died or its loop failed.

        Actor ``a`` is scheduler rank ``a // sp``. In an SP group the lead actor speaks for
        the rank; a request that fails on any actor fails the group (the attention
        all-to-alls of the others are out of step and cannot be replayed).
        """
        with self._lock:
            if ref not in self._refs:  # from before a fail() or rebuild: nothing to say
                return []
            kind, actor = self._refs.pop(ref)
        rank = actor // self.sp
        try:
            result = ray.get(ref, timeout=30)
        except RayActorError as e:
            raise GroupFailure(f"rank {self.first_bundle + actor} died: {_short(e)}") from e
        except RayTaskError as e:
            # Refused by the rank (it re-validates): that request only. In an SP group the
            # other actors may hold it already and would wait for this one: the group fails.
            if kind == "assign" and self.sp == 1:
                return [{"kind": "refused", "rank": rank, "error": _short(e)}]
            raise GroupFailure(f"rank {self.first_bundle + actor} failed: {_short(e)}") from e
        except RayError as e:  # object lost, node died, worker crashed, OOM
            raise GroupFailure(f"rank {self.first_bundle + actor} lost: {_short(e)}") from e
        if kind == "events":
            with self._lock:
                self._poll(actor)
            if self.sp == 1:
                return list(result)
            for e in result:
                if e["kind"] == "finished" and e.get("error"):
                    raise GroupFailure(f"rank {self.first_bundle + actor} failed: {e['error']}")
            return [{**e, "rank": rank} for e in result if actor % self.sp == 0]
        if kind == "serve":
            with self._lock:
                self._serving -= 1
            return [{"kind": "served", "rank": rank, **result}]
        return []

    def fail(self, reason: str) -> None:
        """Mark broken: ranks may still be inside a collective, nothing more goes to them."""
        self.last_error = reason
        self.state = GroupState.BROKEN
        with self._lock:
            self._refs.clear()
            self._serving = 0
        self._gauge(0)

    # -- internals ---------------------------------------------------------------------
    def _poll(self, rank: int) -> None:
        """One long poll per rank, always outstanding: a rank that dies, even idle, shows up."""
        self._refs[self.actors[rank].events.remote(1.0)] = ("events", rank)

    def _kill(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass
        self.actors = []
        with self._lock:
            self._refs.clear()
            self._serving = 0

    def _gauge(self, v: int) -> None:
        metrics()["group_ready"].set(v, tags={"group": self.group_id})

    def refresh_gauges(self) -> None:
        self._gauge(1 if self.ready else 0)


@dataclass
class Engine:
    """The rank groups behind one queue, in one placement group."""

    spec: EngineSpec
    pg: PlacementGroup | None = None
    groups: list[RankGroup] = field(default_factory=list)
    mode_choice: dict[str, Any] | None = None  # --dlo-mode auto: what the probe chose and why
    _own_pg: bool = False

    def __post_init__(self) -> None:
        if not self.groups:
            self.groups = [RankGroup(self.spec, first, size) for first, size in self.spec.group_layout()]

    def place(self) -> None:
        """Reuse the Serve replica's placement group when it has our bundles, else make one."""
        if self.pg is None:
            current = ray.util.get_current_placement_group()
            if current is not None and len(current.bundle_specs) >= len(self.spec.bundles()):
                self.pg = current
            else:
                self.pg = placement_group(self.spec.bundles(), strategy=self.spec.strategy)
                self._own_pg = True
                ray.get(self.pg.ready(), timeout=self.spec.setup_timeout_s)
        for g in self.groups:
            g.pg = self.pg

    def start(self) -> None:
        """Place and start every group, in parallel; raises if none could start."""
        try:
            self.place()
        except Exception as e:  # noqa: BLE001
            for g in self.groups:
                g.state, g.last_error = GroupState.FAILED, f"placement failed: {_short(e)}"
            self._drop_pg()
            raise RuntimeError(f"placement failed: {_short(e)}") from e
        try:
            self._resolve_mode()
        except Exception as e:  # noqa: BLE001
            for g in self.groups:
                g.state, g.last_error = GroupState.FAILED, f"--dlo-mode auto probe failed: {_short(e)}"
            raise RuntimeError(f"--dlo-mode auto probe failed: {_short(e)}") from e
        errors: list[str] = []

        def one(g: RankGroup) -> None:
            try:
                g.start()
            except RuntimeError as e:
                errors.append(str(e))

        threads = [threading.Thread(target=one, args=(g,)) for g in self.groups]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if len(errors) == len(self.groups):
            raise RuntimeError(errors[0])

    def _resolve_mode(self) -> None:
        """``--dlo-mode auto``: probe on bundle 0, then lay the groups out for the chosen mode
        (one AllGather group of N, or N rank-local ranks that each serve their own queue)."""
        opts = self.spec.offload_options
        if not self.spec.offload or opts.get("mode") != "auto" or self.mode_choice is not None:
            return
        strat = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=0)
        ref = ProbeTask.options(num_cpus=self.spec.cpus_per_rank, num_gpus=self.spec.gpus_per_rank,
                                scheduling_strategy=strat).remote(
            self.spec.model_dir, self.spec.device, self.spec.dp_size, opts)
        choice = ray.get(ref, timeout=self.spec.setup_timeout_s)
        log.info("--dlo-mode auto chose %s: %s", choice["mode"], choice["reason"])
        self.mode_choice = choice
        self.spec = replace(self.spec, use_allgather=choice["mode"] == "allgather",
                            offload_options={**opts, "mode": choice["mode"]})
        self.groups = [RankGroup(self.spec, first, size) for first, size in self.spec.group_layout()]
        for g in self.groups:
            g.pg = self.pg

    def close(self) -> None:
        for g in self.groups:
            g.close()
        self._drop_pg()

    def _drop_pg(self) -> None:
        if self._own_pg and self.pg is not None:
            remove_placement_group(self.pg)
        if self._own_pg:
            self.pg, self._own_pg = None, False

    def status(self) -> dict[str, Any]:
        states = [g.state for g in self.groups]
        ready = sum(s is GroupState.READY for s in states)
        if ready == len(states):
            state = "ready"
        elif ready:
            state = "degraded"  # some ranks serve, others rebuild
        else:
            order = ["rebuilding", "starting", "broken", "failed", "new", "closed"]
            state = min((s.value for s in states), key=order.index)
        errors = [g.last_error for g in self.groups if g.last_error and not g.ready]
        return {
            "state": state,
            "dp_size": self.spec.dp_size,
            "sp_size": self.spec.sp_size,
            "groups": [g.status() for g in self.groups],
            "generation": sum(g.generation for g in self.groups),
            "rebuilds": sum(g.rebuilds for g in self.groups),
            "last_error": errors[0] if errors else None,
            "namespace": NAMESPACE,
            "offload_mode": self.mode_choice or {
                "mode": ("allgather" if self.spec.use_allgather else "rank_local") if self.spec.offload
                else "resident", "reason": "set by flags"},
            "workers": [w for g in self.groups for w in g.status()["workers"]],
        }


def _short(e: BaseException, n: int = 300) -> str:
    s = str(e).strip().splitlines()
    return (s[-1] if s else type(e).__name__)[:n]
