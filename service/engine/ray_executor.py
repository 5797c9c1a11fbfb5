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
from .gpus import visible_devices
from .place import NAMESPACE, RankPlace
from .preload import preloadable
from .standby import StandbyRankRemote, WarmRankActorRemote
from .start import probe_mode

log = logging.getLogger("dloserve.engine")
POLL_S = 1.0  # how long one events long poll waits on the rank


def _probe(config: EngineConfig) -> ModeChoice:
    import torch

    # Ray sets CUDA_VISIBLE_DEVICES to this bundle's GPU: it is device 0 here.
    cuda = config.parallel.device == "cuda"
    return probe_mode(config, torch.device("cuda", 0) if cuda else torch.device("cpu"))


ProbeTask = ray.remote(max_retries=0)(_probe)


DevicesTask = ray.remote(max_retries=0)(visible_devices)


class RayExecutor(GroupExecutor):
    """Rank groups as Ray actors; ``placement`` is the Serve replica's placement group when
    it has our bundles (else one is made and removed on close)."""

    def __init__(self, config: EngineConfig, placement: PlacementGroup | None = None,
                 prestarted: list[str] | None = None) -> None:
        super().__init__(config)
        self.placement = placement
        # Rank processes the launcher started before Serve (engine.standby.prestart), by bundle:
        # the first groups adopt them; a name is dropped once adopted or found gone.
        self._prestarted: dict[int, str] = dict(enumerate(prestarted or []))
        self._prestart_gpus: dict[int, str | None] | None = None  # the GPU each loads ahead on
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
            actors, names, started = self._adopt_prestarted(g)
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
        prestarted = all(s.get("prestarted") for s in started)
        standby = all(s["standby"] for s in started) and not prestarted
        imports = max(s["import_s"] for s in started)
        detail = {} if standby else {"prestart.import_s" if prestarted else "actors.import_s": imports}
        if prestarted:  # the task that reads the bundles' GPU ids, part of actors_s
            detail["actors.gpu_ids_s"] = max(s["gpu_ids_s"] for s in started)
        if prestarted:  # imported while Serve started: when the last of them was done
            self.startup["prestart_imported_at"] = max(s["imported_at"] for s in started)
        hosted = prestarted and all(s.get("hosted") for s in started)  # started before Ray (engine.warmhost)
        how = {"standby": standby, "prestarted": prestarted, "hosted": hosted}
        if hosted:  # an import in the host loaded CUDA's driver: its GPU view was the host's
            how["host_cuda_loaded"] = any(s.get("host_cuda_loaded") for s in started)
        log_start(g, facts, {"actors_s": t_up - t0, "rendezvous_s": t_addr - t_up,
                             "setup_s": time.monotonic() - t_addr}, detail,
                  {**how, "pids": [s["pid"] for s in started]})
        self._take_rank_choice(facts)
        self._make_standbys(g, started, facts)
        with self._lock:
            for p in range(g.world):
                self._poll(g, p)

    def _actor(self, g: Group, process: int, name: str, standby: bool = False,
               visible_devices: str | None = None, config: EngineConfig | None = None) -> Any:
        """Rank process ``process`` of ``g`` in its bundle; a standby holds no resources
        (the rank it will replace holds the bundle's) and, in a one-process group, loads the
        pipeline while it waits (engine.preload)."""
        strategy = PlacementGroupSchedulingStrategy(
            self.placement, placement_group_bundle_index=g.info.first_rank + process)
        place = RankPlace(g.info.id, process, g.world, g.info.first_rank)
        remote = StandbyRankRemote if standby else WarmRankActorRemote
        config = config or self.config
        ahead = standby and g.world == 1 and preloadable(config)
        return remote.options(
            name=name, namespace=NAMESPACE, num_cpus=0 if standby else self.config.parallel.cpus_per_rank,
            num_gpus=0 if standby else self.config.parallel.gpus_per_rank, scheduling_strategy=strategy,
            max_restarts=0,
        ).remote(config, place, standby, visible_devices, ahead)

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
                (self._actor(g, p, names[p], True, started[p]["visible_devices"], config), names[p])
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

    def _adopt_prestarted(self, g: Group) -> tuple[list[Any], list[str], list[dict[str, Any]]]:
        """The launcher's pre-started processes of ``g``'s bundles, adopted (engine.standby):
        told the final config, their place and their bundle's GPUs; none if one is missing
        or gone (the caller starts new processes, and the others are stopped)."""
        bundles = [g.info.first_rank + p for p in range(g.world)]
        with self._lock:
            if not self._prestarted:
                return [], [], []
        actors: list[Any] = []
        names: list[str | None] = []
        try:
            self._learn_prestart_gpus()
            t0 = time.monotonic()
            devices = self._bundle_devices(bundles)
            gpu_ids_s = round(time.monotonic() - t0, 3)
            with self._lock:
                names = [self._prestarted.pop(self._prestart_key(b, d), None)
                         for b, d in zip(bundles, devices, strict=True)]
            if None in names:
                raise RuntimeError("not every bundle has one")
            actors = [ray.get_actor(n, namespace=NAMESPACE) for n in names]
            places = [RankPlace(g.info.id, p, g.world, g.info.first_rank) for p in range(g.world)]
            started = self._get([a.adopt.remote(self.config, place, d)
                                 for a, place, d in zip(actors, places, devices, strict=True)])
        except Exception as e:  # noqa: BLE001 - new processes instead
            log.warning("group %s: pre-started rank processes unusable (%s); starting new ones",
                        g.info.id, short(e))
            self._kill_all(actors)
            return [], [], []
        return actors, [str(n) for n in names], [{**s, "prestarted": True, "gpu_ids_s": gpu_ids_s}
                                                 for s in started]

    def _prestart_key(self, bundle: int, devices: str | None) -> int:
        """Which pre-started process a bundle adopts: the one loading ahead on the bundle's
        GPU (engine.standby.prestart chose it before the bundle existed), else the bundle's own."""
        for i, gpu in (self._prestart_gpus or {}).items():
            if devices and gpu == devices and i in self._prestarted:
                return i
        return bundle

    def _learn_prestart_gpus(self) -> None:
        """Each pre-started process's GPU (its ``started`` answer), asked once; one that does
        not answer has none (its bundle's adoption then fails over to a new process)."""
        with self._lock:
            if self._prestart_gpus is not None or not self._prestarted:
                return
            names = dict(self._prestarted)
        gpus: dict[int, str | None] = {}
        for i, name in names.items():
            try:
                actor = ray.get_actor(name, namespace=NAMESPACE)
                gpus[i] = self._get(actor.started.remote()).get("visible_devices")
            except Exception:  # noqa: BLE001 - gone: the adoption says so
                gpus[i] = None
        with self._lock:
            if self._prestart_gpus is None:
                self._prestart_gpus = gpus

    def _bundle_devices(self, bundles: list[int]) -> list[str | None]:
        """The GPUs (CUDA_VISIBLE_DEVICES) Ray gives a rank in each bundle, read by a small
        task there with the rank's GPUs; None for CPU ranks."""
        par = self.config.parallel
        if not par.gpus_per_rank:
            return [None] * len(bundles)
        only = self._only_gpu()
        if only is not None and len(bundles) == 1 and par.gpus_per_rank == 1:
            return [only]  # the cluster's one GPU: no task (a new worker process, 0.7-1 s on the H200)
        refs = [DevicesTask.options(num_cpus=0, num_gpus=par.gpus_per_rank, scheduling_strategy=
                                    PlacementGroupSchedulingStrategy(self.placement,
                                                                     placement_group_bundle_index=b)).remote()
                for b in bundles]
        return self._get(refs)

    def _only_gpu(self) -> str | None:
        """The cluster's GPU where it has one and the pre-started processes all loaded on it
        (they named it as its rank will see it); None otherwise."""
        gpus = set((self._prestart_gpus or {}).values())
        if len(gpus) != 1 or None in gpus or ray.cluster_resources().get("GPU", 0) != 1:
            return None
        return gpus.pop()

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
            left, self._prestarted = list(self._prestarted.values()), {}
        for name in left:  # never adopted (a start that failed before its groups)
            try:
                self._kill_all([ray.get_actor(name, namespace=NAMESPACE)])
            except ValueError:
                pass
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
