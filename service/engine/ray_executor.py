"""The executor on Ray: rank actors in one placement group (the service and the batch job).

A group of N processes is N ``RankActor``s in bundles of the engine's placement group:
one AllGather DP group (one torch.distributed group), or one rank that makes no
collectives (rank-local or resident: each its own group, so one that dies takes only
itself down), or an SP group of S processes that is one rank to the scheduler.

Lifecycle of a group: start (actors: process start and imports; rendezvous; load) -> ready
(and one standby per process starts: engine.standby) -> on a dead rank, a rank error or a
missed deadline it is broken -> rebuild (kill its actors; the standbys, or new actors where
there are none or one died; a new process group on a new port; new standbys). Nothing
waits without a timeout: set-up has one, the long polls have one, the process group has one.

Every process has one ``events`` long poll outstanding while its group is ready, so a
rank that dies, even idle, shows up at once as a dead actor.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from service.config import EngineConfig, ModeChoice, OffloadMode

from .executor import Group, GroupExecutor, Reply, log_start, short
from .place import NAMESPACE, RankPlace
from .preload import preloadable
from .standby import StandbyRankRemote
from .worker import RankActorRemote

log = logging.getLogger("dloserve.engine")
POLL_S = 1.0  # how long one events long poll waits on the rank


def _probe(config: EngineConfig) -> ModeChoice:
    import torch

    from .start import probe_mode  # torch and the model's code: in the probe's process only

    # Ray sets CUDA_VISIBLE_DEVICES to this bundle's GPU: it is device 0 here.
    cuda = config.parallel.device == "cuda"
    return probe_mode(config, torch.device("cuda", 0) if cuda else torch.device("cpu"))


ProbeTask = ray.remote(max_retries=0)(_probe)


class RayExecutor(GroupExecutor):
    """Rank groups as Ray actors; ``placement`` is the Serve replica's placement group when
    it has our bundles (else one is made and removed on close)."""

    def __init__(self, config: EngineConfig, placement: PlacementGroup | None = None) -> None:
        super().__init__(config)
        self.placement = placement
        self._own_placement = False
        # ref -> (group, generation, process, op, job id)
        self._refs: dict[Any, tuple[Group, int, int, str, str]] = {}
        self._standbys: dict[str, list[tuple[Any, str]]] = {}  # group -> (actor, name) per process
        self._standbys_ahead: dict[str, list[Any]] = {}  # group -> refs: each standby loaded ahead?
        self._actor_names: dict[str, list[str]] = {}

    # -- start ------------------------------------------------------------------------
    def start(self) -> None:
        t0 = time.monotonic()
        self.startup["began_at"] = time.time()
        try:
            self._place()
        except Exception as e:  # noqa: BLE001
            self._drop_placement()
            raise RuntimeError(f"placement failed: {short(e)}") from e
        t_placed = time.monotonic()
        self.startup["placement_s"] = round(t_placed - t0, 3)
        if self.config.offload.mode is OffloadMode.AUTO and not self.config.rank_decides_auto:
            self._resolve_auto(self._probe_on_bundle)
            self.startup["auto_probe_s"] = round(time.monotonic() - t_placed, 3)
        self._lay_out()
        self._start_all()

    def _place(self) -> None:
        if self.placement is None:
            current = ray.util.get_current_placement_group()
            if current is not None and len(current.bundle_specs) >= len(self.config.parallel.bundles()):
                self.placement = current
            else:
                par = self.config.parallel
                self.placement = placement_group(par.bundles(), strategy=par.strategy)
                self._own_placement = True
                ray.get(self.placement.ready(), timeout=self.config.parallel.setup_timeout_s)

    def _probe_on_bundle(self) -> ModeChoice:
        """``probe_mode`` on bundle 0 (a Ray task with a rank's resources)."""
        strategy = PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=0)
        par = self.config.parallel
        ref = ProbeTask.options(num_cpus=par.cpus_per_rank, num_gpus=par.gpus_per_rank,
                                scheduling_strategy=strategy).remote(self.config)
        return ray.get(ref, timeout=self.config.parallel.setup_timeout_s)

    def _probe_host(self) -> tuple[str, float] | None:
        """Bundle 0's node: its GPU model (Ray's ``accelerator_type:`` resource; "cpu" on a
        node without GPUs) and its GPU count."""
        assert self.placement is not None
        node = ray.util.placement_group_table(self.placement).get("bundles_to_node_id", {}).get(0)
        res = next((n.get("Resources", {}) for n in ray.nodes() if n.get("NodeID") == node), None)
        if res is None:
            return None
        gpus = res.get("GPU", 0.0)
        kinds = [k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")]
        if gpus and not kinds:
            return None  # a GPU Ray could not name: nothing to key the timings by
        return (kinds[0] if gpus else "cpu", gpus)

    # -- the transport ----------------------------------------------------------------
    def _open(self, g: Group) -> None:
        assert self.placement is not None, "start() places the groups first"
        t0 = time.monotonic()
        actors, names, started = self._take_standbys(g)
        if not actors:
            actors = [self._actor(g, p, self._name(g, p)) for p in range(g.world)]
            names = [self._name(g, p) for p in range(g.world)]
        with self._lock:
            g.handles = actors
            self._actor_names[g.info.id] = names
        if not started:  # a new process: its start and imports are this stage
            started = self._get([a.started.remote() for a in actors])
        t_up = time.monotonic()
        addr = self._get(actors[0].rendezvous_address.remote()) if g.world > 1 else None
        t_addr = time.monotonic()
        facts = self._get([a.setup.remote(addr) for a in actors])
        standby = all(s["standby"] for s in started)
        log_start(g, facts, {"actors_s": t_up - t0, "rendezvous_s": t_addr - t_up,
                             "setup_s": time.monotonic() - t_addr}, None,
                  {"standby": standby, "pids": [s["pid"] for s in started]})
        self._take_rank_choice(facts)
        self._make_standbys(g, started, facts)
        with self._lock:
            for p in range(g.world):
                self._poll(g, p)

    def _actor(self, g: Group, process: int, name: str, standby: dict[str, Any] | None = None,
               config: EngineConfig | None = None) -> Any:
        """Rank process ``process`` of ``g`` in its bundle, with the bundle's CPUs and GPUs; a
        standby (``standby``: the live rank's ``started`` facts) holds no resources (the rank it
        will replace holds the bundle's), takes the rank's GPUs and, in a one-process group,
        loads the pipeline while it waits (engine.preload)."""
        strategy = PlacementGroupSchedulingStrategy(
            self.placement, placement_group_bundle_index=g.info.first_rank + process)
        place = RankPlace(g.info.id, process, g.world, g.info.first_rank)
        par = self.config.parallel
        if standby is None:
            return RankActorRemote.options(
                name=name, namespace=NAMESPACE, num_cpus=par.cpus_per_rank, num_gpus=par.gpus_per_rank,
                scheduling_strategy=strategy, max_restarts=0).remote(self.config, place)
        config = config or self.config
        return StandbyRankRemote.options(
            name=name, namespace=NAMESPACE, num_cpus=0, num_gpus=0, scheduling_strategy=strategy,
            max_restarts=0).remote(config, place, standby["visible_devices"],
                                   g.world == 1 and preloadable(config))

    def _make_standbys(self, g: Group, started: list[dict[str, Any]], facts: list[dict[str, Any]]) -> None:
        """One standby per rank process of a ready group: the rank's GPUs and encoder pool."""
        if not self.config.parallel.use_standby:
            return
        config = self.config
        if config.parallel.encoders_per_rank is None:  # a 0-CPU actor would size its pool from the host
            encoders = max(int(f.get("encoders") or 0) for f in facts)
            config = replace(config, parallel=replace(config.parallel, encoders_per_rank=encoders))
        with self._lock:
            if self._closed:
                return
            self._kill_standbys(g.info.id)
            names = [f"{self._name(g, p)}-standby" for p in range(g.world)]
            self._standbys[g.info.id] = [
                (self._actor(g, p, names[p], started[p], config), names[p])
                for p in range(g.world)]
            self._standbys_ahead[g.info.id] = [a.ahead.remote() for a, _ in self._standbys[g.info.id]]

    def _take_standbys(self, g: Group) -> tuple[list[Any], list[str], list[dict[str, Any]]]:
        """The group's standbys, once they answer (they may still be importing); none if
        there are none or one of them died (the caller starts new processes)."""
        with self._lock:
            standbys = self._standbys.pop(g.info.id, [])
            self._standbys_ahead.pop(g.info.id, None)
        if len(standbys) != g.world:
            self._kill_all([a for a, _ in standbys])
            return [], [], []
        actors = [a for a, _ in standbys]
        try:
            started = self._get([a.started.remote() for a in actors])
        except Exception as e:  # noqa: BLE001 - a dead standby: new processes instead
            log.warning("group %s: standbys unusable (%s); starting new rank processes", g.info.id, short(e))
            self._kill_all(actors)
            return [], [], []
        return actors, [n for _, n in standbys], started

    def _kill_standbys(self, gid: str) -> None:
        self._standbys_ahead.pop(gid, None)
        self._kill_all([a for a, _ in self._standbys.pop(gid, [])])

    @staticmethod
    def _kill_all(actors: list[Any]) -> None:
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass

    def _get(self, refs: Any) -> Any:
        """ray.get within the set-up timeout, giving up at once when the executor closes."""
        end = time.monotonic() + self.config.parallel.setup_timeout_s
        while True:
            try:
                return ray.get(refs, timeout=0.5)
            except GetTimeoutError:
                if self._closed:
                    raise RuntimeError("executor closed during set-up") from None
                if time.monotonic() > end:
                    timeout = self.config.parallel.setup_timeout_s
                    raise RuntimeError(f"set-up took longer than {timeout:.0f} s") from None

    def _kill(self, g: Group) -> None:
        self._kill_all(g.handles)
        g.handles = []
        self._refs = {r: v for r, v in self._refs.items() if v[0] is not g}

    def _send(self, g: Group, process: int, op: str, *args: Any) -> None:
        ref = getattr(g.handles[process], op).remote(*args)
        self._refs[ref] = (g, g.generation, process, op, str(args[0]) if args else "")

    def _poll(self, g: Group, process: int) -> None:
        self._send(g, process, "events", POLL_S)

    def _replies(self, timeout: float) -> list[tuple[Group, int, int, Reply]]:
        with self._lock:
            refs = [r for r, v in self._refs.items() if v[0].state.value == "ready"]
        if not refs:
            time.sleep(timeout)
            return []
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        out = []
        for ref in ready:
            with self._lock:
                entry = self._refs.pop(ref, None)
            if entry is None:
                continue  # its group was killed meanwhile
            g, generation, process, op, job = entry
            reply = self._reply(ref, op, job)
            if op == "events" and reply.kind == "events":
                with self._lock:
                    if g.generation == generation and g.handles:
                        self._poll(g, process)
            if reply.kind != "none":
                out.append((g, generation, process, reply))
        return out

    def _reply(self, ref: Any, op: str, job: str) -> Reply:
        from .events import Event, EventKind

        try:
            result = ray.get(ref, timeout=30)
        except RayActorError as e:
            return Reply("lost", error=short(e))
        except RayError as e:  # a task error; object lost, node died, worker crashed, OOM
            if op == "assign":
                # The actor lives (a dead one is a RayActorError above, and its events poll
                # says so too): whatever went wrong is this request's, never the rank's death.
                return Reply("refused", (Event(EventKind.REFUSED, job_id=job),), short(e))
            return Reply("failed" if isinstance(e, RayTaskError) else "lost", error=short(e))
        if op == "assign" and result:  # the rank re-validates: that request only
            return Reply("refused", (Event(EventKind.REFUSED, job_id=job),), str(result))
        if op == "events":
            return Reply("events", tuple(result))
        if op == "serve":
            return Reply("served")
        return Reply("none")

    def _names(self, g: Group) -> list[str]:
        return list(self._actor_names.get(g.info.id, []))[:len(g.handles)]

    def _name(self, g: Group, process: int) -> str:
        return f"dloserve-{g.info.id}-gen{g.generation}-rank{process}"

    def close(self) -> None:
        super().close()
        with self._lock:
            for gid in list(self._standbys):
                self._kill_standbys(gid)
        self._drop_placement()

    def _drop_placement(self) -> None:
        if self._own_placement and self.placement is not None:
            remove_placement_group(self.placement)
        if self._own_placement:
            self.placement, self._own_placement = None, False

    def status(self) -> dict[str, Any]:
        with self._lock:
            standbys = {gid: [n for _, n in sb] for gid, sb in self._standbys.items()}
            ahead = {gid: self._loaded_ahead(gid) for gid in standbys}
        return {**super().status(), "namespace": NAMESPACE, "standbys": standbys, "standbys_loaded": ahead}

    def _loaded_ahead(self, gid: str) -> bool | None:
        """Whether every standby of ``gid`` has loaded ahead (engine.preload): None while one
        is still importing or loading, False where one does not (or could not)."""
        refs = self._standbys_ahead.get(gid, [])
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        if len(done) < len(refs) or not refs:
            return None
        try:
            return all(ray.get(done, timeout=1))
        except Exception:  # noqa: BLE001 - a standby that died: the rebuild starts new processes
            return False
