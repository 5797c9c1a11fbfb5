"""The job-store actor: the one owner of job records for a results URL on a Ray cluster.

Every replica, on every node, reads and writes jobs through it, so a job made by one
replica is found, listed, downloaded and deleted through any other. It is a detached,
named actor (``dloserve-jobs-<hash of the URL>``) pinned to the head node (whose loss
ends the cluster anyway) and restarted by Ray if its process dies; its records persist
in the results storage, so a restart reloads them.

It also notices lost DP groups: each replica heartbeats every second; a group that has
held unfinished jobs and has not been heard from for ``group_timeout_s`` lost its
replica (or its node), and its queued and running jobs end ``failed`` with that reason.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from service.api.results import ResultStorage
from service.api.store import JobTable

NAMESPACE = "dloserve"
log = logging.getLogger("dloserve.jobs")


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

    def __init__(self, url: str, storage_options: dict[str, Any], ttl_s: float, max_jobs: int,
                 group_timeout_s: float) -> None:
        super().__init__(ResultStorage(url, storage_options), ttl_s, max_jobs, exclusive=True)
        self.group_timeout_s = group_timeout_s
        self.started = time.monotonic()
        self._seen: dict[str, tuple[float, str]] = {}  # dp group -> (last heartbeat, node id)
        self._cancelled: dict[str, list[str]] = {}  # dp group -> queued jobs deleted elsewhere
        self._beat_lock = threading.Lock()
        self.groups_lost: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="dloserve-reaper", daemon=True)
        self._reaper.start()

    def close(self) -> None:
        """Stop the reaper (an in-process store; the actor's ends with its process)."""
        self._stop.set()
        self._reaper.join(timeout=5)

    def delete(self, job_id: str) -> bool:
        rec = self.get(job_id)
        if rec is not None and rec.status.value == "queued":
            self.request_cancel(job_id)  # its group drops it from its queue at the next heartbeat
        return super().delete(job_id)

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
        while not self._stop.wait(0.5):
            try:
                self.reap()
            except Exception:  # noqa: BLE001 - keep noticing; the next round retries
                log.exception("reaping lost DP groups failed")

    def reap(self) -> int:
        """Fail the jobs of groups silent for ``group_timeout_s``; returns how many."""
        now, failed = time.monotonic(), 0
        for g in self.live_groups():
            with self._beat_lock:
                last, node = self._seen.get(g, (self.started, "unknown"))
            silent = now - last
            if silent <= self.group_timeout_s:
                continue
            ids = self.unfinished(g)
            why = (f"DP group {g} on node {node} stopped answering ({silent:.0f} s without a heartbeat: "
                   "its replica or node is gone) before this job ended; submit it again")
            n = self.fail(ids, "dp_group_lost", why)
            if n:
                from service.engine.metrics import metrics

                log.warning("DP group %s on node %s lost: failed %d jobs", g, node, n)
                metrics()["groups_lost"].inc(1, tags={"node": node[:12]})
                metrics()["requests"].inc(n, tags={"status": "failed"})  # its replica cannot count them
                self.groups_lost.append({"dp_group": g, "node_id": node, "failed": n, "at": time.time()})
            failed += n
        return failed


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


def connect_store(url: str, storage_options: dict[str, Any] | None = None, ttl_s: float = 86400.0,
                  max_jobs: int = 1000, group_timeout_s: float = 30.0) -> JobStoreClient:
    """The cluster's store for ``url``, started on the head node if it is not running yet
    (the first caller's retention settings are the ones it keeps)."""
    actor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1, max_concurrency=32)(JobStore)
    handle = actor.options(
        name=store_name(url), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(head_node_id(), soft=False),
    ).remote(url, storage_options or {}, ttl_s, max_jobs, group_timeout_s)
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
