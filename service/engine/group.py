"""A DP group: N worker actors in a placement group, one torch.distributed group.

Lifecycle: start (actors, rendezvous, load) -> ready -> run_wave ... -> on a dead rank,
a rank error or a missed deadline the wave's requests fail with a reason and the group is
marked broken -> rebuild (kill every actor, new actors, new process group on a new port).
Nothing waits without a timeout: setup, waves and progress polls all have one, and the
process group itself has one so a rank stuck in a collective eventually errors out.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from service.engine.metrics import metrics
from service.engine.worker import DPWorkerActor, WorkerSpec

log = logging.getLogger("dloserve.engine")
NAMESPACE = "dloserve"
ProgressFn = Callable[[int, int, int], None]  # (dp_rank, step, total)


@dataclass(frozen=True)
class EngineSpec:
    """How to build a DP group; one per ingress replica or batch job."""

    model_dir: str
    dp_size: int = 1
    offload: bool = True
    use_allgather: bool = True
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0
    strategy: str = "STRICT_PACK"
    pg_timeout_s: float = 3600.0  # last resort: the wave deadline tears the group down first
    setup_timeout_s: float = 900.0
    poll_s: float = 0.25

    def bundles(self) -> list[dict[str, float]]:
        """One bundle per rank; a Serve replica with 0 CPUs rides in bundle 0."""
        b: dict[str, float] = {"CPU": self.cpus_per_rank}
        if self.gpus_per_rank:
            b["GPU"] = self.gpus_per_rank
        return [dict(b) for _ in range(self.dp_size)]

    @property
    def device(self) -> str:
        return "cuda" if self.gpus_per_rank else "cpu"


@dataclass
class Outcome:
    """The result for one request of a wave (index i ran on dp_rank i)."""

    dp_rank: int
    mp4: bytes | None = None
    error: str | None = None
    seconds: float = 0.0
    stats: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.mp4 is not None and self.error is None


@dataclass
class DPGroup:
    """Owns the actors; thread-safe for one wave at a time plus concurrent status reads."""

    spec: EngineSpec
    pg: PlacementGroup | None = None
    group_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    state: str = "new"  # new|starting|ready|broken|rebuilding|failed|closed
    generation: int = 0
    last_error: str | None = None
    rebuilds: int = 0
    actors: list[Any] = field(default_factory=list)
    _own_pg: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Create actors in the placement group, rendezvous, load; raises on failure."""
        self.state = "starting" if self.generation == 0 else "rebuilding"
        self._gauge(0)
        self.actors = []
        wspec = WorkerSpec(
            model_dir=self.spec.model_dir,
            world=self.spec.dp_size,
            device=self.spec.device,
            offload=self.spec.offload,
            use_allgather=self.spec.use_allgather,
            pg_timeout_s=self.spec.pg_timeout_s,
            group_id=self.group_id,
        )
        try:
            if self.pg is None:
                self.pg = self._placement_group()
            for r in range(self.spec.dp_size):
                strat = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r)
                self.actors.append(
                    DPWorkerActor.options(
                        name=self.actor_name(r),
                        namespace=NAMESPACE,
                        num_cpus=self.spec.cpus_per_rank,
                        num_gpus=self.spec.gpus_per_rank,
                        scheduling_strategy=strat,
                        max_restarts=0,
                    ).remote(r, wspec)
                )
            timeout = self.spec.setup_timeout_s
            addr = ray.get(self.actors[0].rendezvous_address.remote(), timeout=timeout)
            facts = ray.get([a.setup.remote(addr) for a in self.actors], timeout=timeout)
        except Exception as e:  # noqa: BLE001 - any start failure leaves a clean, failed group
            self.last_error = f"group start failed: {_short(e)}"
            self._kill()
            if self._own_pg and self.pg is not None and self.state != "ready":
                remove_placement_group(self.pg)  # e.g. it never fitted: try afresh next time
                self.pg, self._own_pg = None, False
            self.state = "failed"
            raise RuntimeError(self.last_error) from e
        log.info("DP group %s gen %d ready: %s", self.group_id, self.generation, facts)
        self.state = "ready"
        self._gauge(1)

    def rebuild(self, reason: str, attempts: int = 3) -> bool:
        """Tear everything down and start again on new actors; True once ready."""
        metrics()["rebuilds"].inc(1, tags={"group": self.group_id, "reason": reason[:40]})
        self.rebuilds += 1
        for i in range(attempts):
            self._kill()
            self.generation += 1
            self.state = "rebuilding"
            try:
                self.start()
                return True
            except RuntimeError:
                log.exception("rebuild attempt %d failed", i + 1)
                time.sleep(min(5.0, 0.5 * 2**i))
        return False

    def close(self) -> None:
        self._kill()
        if self._own_pg and self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
        self.state = "closed"
        self._gauge(0)

    def actor_name(self, rank: int) -> str:
        return f"dloserve-{self.group_id}-gen{self.generation}-rank{rank}"

    def status(self) -> dict[str, Any]:
        return {
            "group": self.group_id,
            "state": self.state,
            "generation": self.generation,
            "dp_size": self.spec.dp_size,
            "rebuilds": self.rebuilds,
            "last_error": self.last_error,
            "namespace": NAMESPACE,
            "workers": [self.actor_name(r) for r in range(len(self.actors))],
        }

    # -- waves -------------------------------------------------------------------------
    def run_wave(
        self, reqs: list[Any], deadline_s: float, on_progress: ProgressFn | None = None
    ) -> list[Outcome]:
        """One call to all N ranks; rank r runs reqs[r], the rest idle-replay reqs[0]."""
        if not 1 <= len(reqs) <= self.spec.dp_size:
            raise ValueError(f"wave of {len(reqs)} for dp_size {self.spec.dp_size}")
        if self.state != "ready":
            why = f"DP group not ready ({self.state})"
            return [Outcome(r, error=why) for r in range(len(reqs))]
        with self._lock:
            try:
                return self._run(reqs, deadline_s, on_progress)
            except BaseException as e:
                # Ranks may still be inside this wave: never send another to them.
                self.last_error = f"wave aborted: {_short(e)}"
                self.state = "broken"
                self._gauge(0)
                raise

    def _run(
        self, reqs: list[Any], deadline_s: float, on_progress: ProgressFn | None
    ) -> list[Outcome]:
        m, tags = metrics(), {"group": self.group_id}
        wave_id = uuid.uuid4().hex[:12]
        t0 = time.monotonic()
        end = t0 + deadline_s
        refs = {a.run.remote(wave_id, reqs): r for r, a in enumerate(self.actors)}
        results: dict[int, dict[str, Any]] = {}
        failure: str | None = None
        while refs and failure is None:
            done, _ = ray.wait(list(refs), num_returns=1, timeout=self.spec.poll_s)
            for ref in done:
                rank = refs.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except RayActorError as e:
                    failure = f"rank {rank} died: {_short(e)}"
                except RayTaskError as e:
                    failure = f"rank {rank} failed: {_short(e)}"
                except RayError as e:  # object lost, node died, worker crashed, OOM
                    failure = f"rank {rank} lost: {_short(e)}"
            if failure is None and refs and time.monotonic() > end:
                failure = f"wave deadline of {deadline_s:.0f}s exceeded"
            if failure is None and on_progress is not None:
                self._poll_progress(wave_id, len(reqs), on_progress)
        elapsed = time.monotonic() - t0
        m["wave_size"].observe(len(reqs), tags=tags)
        m["wave_latency"].observe(elapsed, tags={**tags, "outcome": "failed" if failure else "ok"})
        outcomes = []
        for i in range(len(reqs)):
            res = results.get(i)
            if res is not None and res.get("mp4") is not None:
                outcomes.append(Outcome(i, res["mp4"], None, res["seconds"], res.get("stats")))
            else:
                outcomes.append(Outcome(i, error=failure or "rank returned no output"))
        if failure is not None:
            log.warning("wave %s failed: %s", wave_id, failure)
            self.last_error = failure
            self.state = "broken"
            self._gauge(0)
        return outcomes

    def _poll_progress(self, wave_id: str, n: int, on_progress: ProgressFn) -> None:
        refs = [self.actors[r].progress.remote() for r in range(n)]
        try:
            got = ray.get(refs, timeout=max(1.0, self.spec.poll_s * 4))
        except (RayError, GetTimeoutError):
            return  # a dead rank shows up on its run() ref; progress is best effort
        for r, p in enumerate(got):
            if p.get("wave") == wave_id and p.get("total"):
                on_progress(r, int(p["step"]), int(p["total"]))

    # -- internals ---------------------------------------------------------------------
    def _placement_group(self) -> PlacementGroup:
        """Reuse the Serve replica's placement group when it has our bundles, else make one."""
        current = ray.util.get_current_placement_group()
        if current is not None and len(current.bundle_specs) >= self.spec.dp_size:
            return current
        pg = placement_group(self.spec.bundles(), strategy=self.spec.strategy)
        self.pg, self._own_pg = pg, True  # ours to remove, even if it never becomes ready
        ray.get(pg.ready(), timeout=self.spec.setup_timeout_s)
        return pg

    def _kill(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass
        self.actors = []

    def _gauge(self, v: int) -> None:
        metrics()["group_ready"].set(v, tags={"group": self.group_id})

    def refresh_gauges(self) -> None:
        self._gauge(1 if self.state == "ready" else 0)


def _short(e: BaseException, n: int = 300) -> str:
    s = str(e).strip().splitlines()
    return (s[-1] if s else type(e).__name__)[:n]
