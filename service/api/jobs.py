"""The job-store actor: the one owner of job records for a results URL on a Ray cluster.

Every replica, on every node, reads and writes jobs through it, so a job made by one
replica is found, listed, downloaded and deleted through any other. It is a detached,
named actor (``dloserve-jobs-<hash of the URL>``) pinned to the head node (whose loss
ends the cluster anyway) and restarted by Ray if its process dies; its records persist
in the results storage, so a restart reloads them.

It also notices lost DP groups: each replica heartbeats every second; a group that has
held unfinished jobs and has not been heard from for ``group_timeout_s`` lost its
replica (or its node). Its queued and running jobs go back to the store's own queue, and
a serving replica of the same model takes them over (``adopt``, at its heartbeat) and runs
them again: once per job, and only jobs whose request the store was given (``put``); the
others, a job lost a second time, and one no replica takes within ``ADOPT_WAIT_S``, end
``failed`` with the reason.

Requests are kept beside their records (``<id>.req``, durable.py), and the replicas keep
each running job's last per-step state there (``<id>.state``): after a restart of the store
on the same results (a new ``serve``, a new cluster), every unfinished job whose DP group's
node is gone shows ``queued`` at once and a serving replica takes it over, going on from its
saved step; one whose request cannot be read fails with the reason, as before.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from service.api.durable import read_request, read_state, request_bytes
from service.api.records import JobRecord, JobStatus
from service.api.results import ResultStorage
from service.api.store import JobTable
from service.api.webhooks import Webhooks
from service.models.request import GenerationRequest

NAMESPACE = "dloserve"
ADOPT_WAIT_S = 300.0  # a lost group's job waits this long for another replica to take it
CONFIRM_WAIT_S = 120.0  # a taken job its replica has not confirmed holding by then is taken back
log = logging.getLogger("dloserve.jobs")


def live_nodes() -> set[str]:
    """The ids of the cluster's live nodes (none without Ray: nothing of before can be alive)."""
    try:
        if not ray.is_initialized():
            return set()
        return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    except Exception:  # noqa: BLE001 - a store that cannot ask waits for heartbeats instead
        log.exception("could not list the cluster's nodes")
        return set()


def store_name(url: str) -> str:
    return "dloserve-jobs-" + hashlib.sha256(url.encode()).hexdigest()[:16]


def head_node_id() -> str:
    for n in ray.nodes():
        if n.get("Alive") and "node:__internal_head__" in n.get("Resources", {}):
            return n["NodeID"]
    return ray.get_runtime_context().get_node_id()


class JobStore(JobTable):
    """The job table plus the replicas' heartbeats and the reaper of lost DP groups: what
    every replica talks to. On a cluster it runs as a threaded actor (calls from many
    replicas at once; the table holds the lock); a test may use one in-process."""

    def __init__(self, url: str, storage_options: dict[str, Any], retention_s: float, max_jobs: int,
                 group_timeout_s: float, webhooks: dict[str, Any] | None = None) -> None:
        super().__init__(ResultStorage(url, storage_options), retention_s, max_jobs, exclusive=True)
        # Every job that ends, here, announced once: on any replica, or failed by the reaper.
        self.webhooks = Webhooks.from_config(webhooks)
        self.on_final = self.webhooks.on_final if self.webhooks else None
        self.group_timeout_s = group_timeout_s
        self.started = time.monotonic()
        self._seen: dict[str, tuple[float, str]] = {}  # dp group -> (last heartbeat, node id)
        self._cancelled: dict[str, list[str]] = {}  # dp group -> queued jobs deleted elsewhere
        self._beat_lock = threading.Lock()
        self.groups_lost: list[dict[str, Any]] = []
        self._requests: dict[str, Any] = {}  # unfinished job -> its request (to run it elsewhere)
        self._orphans: dict[str, tuple[float, str]] = {}  # job of a lost group -> (since, why)
        self._adopted: set[str] = set()  # jobs run again once already: a second loss fails them
        self._models: dict[str, float] = {}  # model -> when a replica serving it last asked to adopt
        self._unconfirmed: dict[str, tuple[float, str]] = {}  # job taken by adopt -> (when, by which group)
        self._recover()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="dloserve-reaper", daemon=True)
        self._reaper.start()

    def close(self) -> None:
        """Stop the reaper (an in-process store; the actor's ends with its process)."""
        self._stop.set()
        self._reaper.join(timeout=5)
        if self.webhooks is not None:
            self.webhooks.close()

    def _recover(self) -> None:
        """At start: unfinished jobs whose request was kept run again (those whose group's node
        is gone at once, the others once their group is silent for ``group_timeout_s``: this
        may be a restart of the store alone); a job no group holds with no request kept fails."""
        live, now, n = live_nodes(), time.monotonic(), 0
        for rec in self.list():
            if rec.final:
                continue
            try:
                request = read_request(self.storage, rec.id)
            except ValueError as e:  # this job cannot run again; the others still can
                log.warning("job %s cannot run again: its request file %s", rec.id, e)
                if not rec.dp_group or rec.node_id not in live:
                    self.fail([rec.id], "dp_group_lost", f"the service restarted before this job ended, and "
                              f"its kept request cannot be used ({str(e)[:300]}); submit it again")
                continue
            if request is None:
                if not rec.dp_group:
                    self.fail([rec.id], "dp_group_lost", "its DP group was lost and the job store restarted "
                              "before another replica took the job over; submit it again")
                continue
            self._requests[rec.id] = request
            if not rec.dp_group or rec.node_id not in live:
                self._orphans[rec.id] = (now, "the service restarted before this job ended")
                self.update(rec.id, dp_group=None, node_id=None, status=JobStatus.QUEUED, progress=0,
                            wave=None, dp_rank=None)
                n += 1
        if n:
            log.info("%d unfinished jobs of before the restart wait for a replica to run them again", n)
        keep = set(self._requests)
        for name in self.storage.names(".req") + self.storage.names(".state"):
            if name.rsplit(".", 1)[0] not in keep:  # a job that ended or went (a late write of its state)
                self.storage.remove(name)

    def put(self, rec: JobRecord, request: Any = None) -> None:
        """Record a job; with its ``request``, the job can run again on another replica if its
        own is lost, or after a restart (kept in memory and beside the record, until the job
        ends). StorageError, and nothing kept, when a write fails."""
        if isinstance(request, GenerationRequest):  # (another payload, a test's: in memory only)
            self.storage.put_bytes(f"{rec.id}.req", request_bytes(request))
        try:
            super().put(rec)
        except Exception:
            self.storage.remove(f"{rec.id}.req")
            raise
        if request is not None:
            with self._beat_lock:
                self._requests[rec.id] = request

    def finish(self, job_id: str, by: str | None = None, **fields: Any) -> JobRecord | None:
        ended = super().finish(job_id, by=by, **fields)
        if ended is not None:
            self._forget(job_id)
            for ext in ("req", "state"):  # nothing to run again
                self.storage.remove(f"{job_id}.{ext}")
        return ended

    def delete(self, job_id: str) -> bool:
        rec = self.get(job_id)
        if rec is not None and rec.status.value == "queued":
            self.request_cancel(job_id)  # its group drops it from its queue at the next heartbeat
        self._forget(job_id)
        return super().delete(job_id)

    def _forget(self, job_id: str) -> None:
        with self._beat_lock:
            self._requests.pop(job_id, None)
            self._orphans.pop(job_id, None)
            self._adopted.discard(job_id)
            self._unconfirmed.pop(job_id, None)

    def adopt(self, dp_group: str, node_id: str, model: str, limit: int) -> list[tuple[str, Any, str | None]]:
        """Up to ``limit`` jobs of lost groups for a serving replica of ``model`` to run, oldest
        first: (id, request, owner), the request resumed from its kept state where there is
        one of its own that it can go on from. They are its jobs from now on. A job is taken
        only with its record updated: one that cannot be is left for the next call."""
        taken: list[tuple[str, Any, str | None]] = []
        with self._beat_lock:
            self._models[model] = time.monotonic()
            waiting = sorted(self._orphans.items(), key=lambda kv: kv[1][0])
        for job_id, _ in waiting:
            if len(taken) >= limit:
                break
            rec = self.get(job_id)
            if rec is None or rec.final or rec.model != model:
                continue
            with self._beat_lock:
                orphan = self._orphans.pop(job_id, None)
                if orphan is None:
                    continue  # another replica took it meanwhile
                request = self._requests.get(job_id)
            state = None if request is None else read_state(self.storage, job_id, request)  # never raises
            try:  # the step it goes on from is the one written, not the one its lost group kept last
                self.update(job_id, dp_group=dp_group, node_id=node_id,
                            resumable_step=state.step if state else 0)
            except Exception:  # noqa: BLE001 - a refused write: it waits for the next adopt
                log.exception("could not hand %s to DP group %s", job_id, dp_group)
                with self._beat_lock:
                    self._orphans[job_id] = orphan
                break
            with self._beat_lock:
                self._adopted.add(job_id)
                self._unconfirmed[job_id] = (time.monotonic(), dp_group)
            taken.append((job_id, request if state is None else request.resumed(state), rec.owner))
        if taken:
            log.info("DP group %s on node %s took over %d jobs of lost groups", dp_group, node_id, len(taken))
        return taken

    def confirm(self, dp_group: str, ids: list[str]) -> None:
        """``dp_group`` holds (or has ended) these jobs ``adopt`` gave it. One never confirmed
        (the answer to ``adopt`` lost on the way, a replica that failed between) is taken back
        after ``CONFIRM_WAIT_S``: held by no dispatcher, it would wait as ``queued`` forever."""
        with self._beat_lock:
            for i in ids:
                if self._unconfirmed.get(i, (0.0, dp_group))[1] == dp_group:
                    self._unconfirmed.pop(i, None)

    def _reclaim(self, now: float) -> None:
        with self._beat_lock:
            late = [(i, g) for i, (at, g) in self._unconfirmed.items() if now - at > CONFIRM_WAIT_S]
        for i, g in late:
            rec = self.get(i)
            with self._beat_lock:
                self._unconfirmed.pop(i, None)
                if rec is None or rec.final or rec.dp_group != g:
                    continue
                self._adopted.discard(i)
                self._orphans[i] = (now, f"DP group {g} took this job over but never confirmed it")
                self._cancelled.setdefault(g, []).append(i)  # should it hold it after all: it stops
            log.warning("DP group %s never confirmed taking over %s: it waits for a replica again", g, i)
            self.update(i, dp_group=None, node_id=None, status=JobStatus.QUEUED, progress=0, wave=None,
                        dp_rank=None)

    def request_cancel(self, job_id: str) -> None:
        """Tell the job's DP group, at its next heartbeat, to cancel it."""
        rec = self.get(job_id)
        if rec is not None and rec.dp_group and not rec.final:
            with self._beat_lock:
                self._cancelled.setdefault(str(rec.dp_group), []).append(job_id)

    # -- groups ------------------------------------------------------------------------
    def heartbeat(self, dp_group: str, node_id: str) -> list[str]:
        """A replica is alive; answers the ids of its jobs deleted or cancelled elsewhere."""
        with self._beat_lock:
            self._seen[dp_group] = (time.monotonic(), node_id)
            return self._cancelled.pop(dp_group, [])

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        with self._beat_lock:
            groups = {g: {"node_id": n, "last_heartbeat_s": round(now - t, 1)}
                      for g, (t, n) in self._seen.items()}
        return {"groups": groups, "groups_lost": list(self.groups_lost), "jobs": len(self.list()),
                "unfinished": len(self.unfinished())}

    def _reap_loop(self) -> None:
        swept = time.monotonic()
        while not self._stop.wait(0.5):
            try:
                self.reap()
                if time.monotonic() - swept > 60:  # temp files of writers killed since the start
                    swept = time.monotonic()
                    self.storage.sweep_tmp()
            except Exception:  # noqa: BLE001 - keep noticing; the next round retries
                log.exception("reaping lost DP groups failed")

    def reap(self) -> int:
        """Fail the jobs of groups silent for ``group_timeout_s``; returns how many."""
        now, failed = time.monotonic(), 0
        self._reclaim(now)
        for g in self.live_groups():
            with self._beat_lock:
                last, node = self._seen.get(g, (self.started, "unknown"))
            silent = now - last
            if silent <= self.group_timeout_s:
                continue
            ids = self.unfinished(g)
            lost = f"DP group {g} on node {node} stopped answering ({silent:.0f} s without a heartbeat: " \
                   "its replica or node is gone) before this job ended"
            with self._beat_lock:
                again = [i for i in ids if i in self._requests and i not in self._adopted]
                for i in again:
                    self._orphans[i] = (now, lost)
                if again:  # should the group only have been silent, it stops its copies
                    self._cancelled.setdefault(g, []).extend(again)
            for i in again:  # no group holds them now: a serving replica adopts them
                self.update(i, dp_group=None, node_id=None, status=JobStatus.QUEUED, progress=0, wave=None,
                            dp_rank=None)
            n = self.fail([i for i in ids if i not in again], "dp_group_lost", f"{lost}; submit it again")
            if n or again:
                self._lost(g, node, n, len(again))
            failed += n
        return failed + self._expire_orphans(now)

    def _expire_orphans(self, now: float) -> int:
        with self._beat_lock:
            late = [(i, why) for i, (since, why) in self._orphans.items() if now - since > ADOPT_WAIT_S]
            serving = sorted(m for m, at in self._models.items() if now - at <= max(ADOPT_WAIT_S, 60.0))
        n = 0
        for i, why in late:
            rec = self.get(i)
            model = repr(rec.model) if rec is not None else "its model"
            here = f"replicas here serve {', '.join(map(repr, serving))}" if serving else "no replica asked"
            n += self.fail([i], "dp_group_lost", f"{why}, and no replica of model {model} took it over "
                           f"within {ADOPT_WAIT_S:.0f} s ({here}); submit it again")
        if n:
            from service.engine.metrics import metrics

            metrics()["requests"].inc(n, tags={"status": "failed"})
        return n

    def _lost(self, g: str, node: str, failed: int, again: int) -> None:
        from service.engine.metrics import metrics

        log.warning("DP group %s on node %s lost: %d jobs failed, %d to run again elsewhere", g, node,
                    failed, again)
        metrics()["groups_lost"].inc(1, tags={"node": node[:12]})
        if failed:
            metrics()["requests"].inc(failed, tags={"status": "failed"})  # its replica cannot count them
        self.groups_lost.append({"dp_group": g, "node_id": node, "failed": failed, "run_again": again,
                                 "at": time.time()})


class JobStoreClient:
    """What a replica holds: the store's methods (JobStore's, so JobTable's), each a
    blocking call on the actor; Ray retries them across an actor restart."""

    def __init__(self, handle: Any, timeout_s: float = 60.0) -> None:
        self.handle = handle
        self.timeout_s = timeout_s

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_") or not callable(getattr(JobStore, method, None)):
            raise AttributeError(method)
        remote = getattr(self.handle, method)

        def call(*args: Any, **kwargs: Any) -> Any:
            return ray.get(remote.remote(*args, **kwargs), timeout=self.timeout_s)

        return call


def connect_store(url: str, storage_options: dict[str, Any] | None, *, retention_s: float,
                  max_jobs: int, group_timeout_s: float,
                  webhooks: dict[str, Any] | None = None) -> JobStoreClient:
    """The cluster's store for ``url``, started on the head node if it is not running yet
    (the first caller's retention and webhook settings are the ones it keeps; the settings'
    defaults are ServiceConfig's)."""
    actor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1, max_concurrency=32)(JobStore)
    handle = actor.options(
        name=store_name(url), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(head_node_id(), soft=False),
    ).remote(url, storage_options or {}, retention_s, max_jobs, group_timeout_s, webhooks)
    client = JobStoreClient(handle)
    client.status()  # fail here, with the store's own error, if it cannot start
    return client


def stop_store(url: str) -> bool:
    """Kill the store for ``url`` (the launcher, when it deletes its app); False if none."""
    try:
        ray.kill(ray.get_actor(store_name(url), namespace=NAMESPACE), no_restart=True)
        return True
    except ValueError:
        return False


__all__ = ["JobStore", "JobStoreClient", "connect_store", "stop_store", "store_name"]
