"""The replica's heartbeat, two threads. The liveness one, once a second and nothing else,
tells the job store this DP group lives (or, silent for ``group_timeout_s``, its jobs are taken
away) and cancels the jobs deleted through another replica. The work one, four times a
second, sends buffered job events to the store (``JobSink.flush``), probes the results
storage, writes running jobs' states and, once a second, takes over jobs of lost DP groups
while it has room. Apart, because the work waits on storage: taking over four jobs took
2.7 s on the 2-core CI machine (reading their states, rewriting their records), and when
the group's beat waited behind it for more than ``group_timeout_s`` the store failed the
jobs it had just handed over as lost a second time (``make multinode``, 2026-12-05).

A beat that fails (the store restarting) is logged and tried again at the next one; a work
round slower than ``SLOW_S`` is logged with what it waited on.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from service.api.durable import StateKeeper, usable_state
from service.api.sink import JobSink
from service.api.storage_health import StorageHealth
from service.api.store import JobTable
from service.models.request import GenerationRequest
from service.router.health import Availability

log = logging.getLogger("dloserve.api")
BEAT_S = 0.25  # buffered events, the storage probe, due states
ALIVE_S = 1.0  # the store's liveness, cancels from other replicas, adoption
SLOW_S = 2.0  # a work round this slow is logged


class Beating(Protocol):
    """What the heartbeat reads of its replica (``VideoService``)."""

    sink: JobSink
    store: JobTable
    storage_health: StorageHealth
    states: StateKeeper
    dispatcher: Any
    cfg: Any
    adapter: Any
    dp_group: str
    node_id: str
    model_name: str

    def draining(self) -> str | None: ...

    def revoked(self, owner: str | None) -> bool: ...


class Heartbeat:
    """The threads that keep one DP group's standing in the job store."""

    def __init__(self, svc: Beating) -> None:
        self.svc = svc
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._alive, name="dloserve-heartbeat", daemon=True),
                         threading.Thread(target=self._work, name="dloserve-store-work", daemon=True)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._closed.set()
        for t in self._threads:
            t.join(timeout=timeout_s)

    def _alive(self) -> None:
        svc = self.svc
        while True:
            try:
                for job_id in svc.store.heartbeat(svc.dp_group, svc.node_id):
                    svc.dispatcher.cancel(job_id)
            except Exception as e:  # noqa: BLE001 - the store restarting: try again next beat
                log.warning("heartbeat to the job store failed: %s", e)
            if self._closed.wait(ALIVE_S):
                return

    def _work(self) -> None:
        svc = self.svc
        last = 0.0
        while not self._closed.wait(BEAT_S):
            took: dict[str, float] = {}
            steps = [("events", svc.sink.flush), ("probe", svc.storage_health.probe),
                     ("states", svc.states.write_due)]
            if time.monotonic() - last >= ALIVE_S:
                steps.append(("adopt", self._adopt))
                last = time.monotonic()
            for name, step in steps:
                t = time.monotonic()
                try:
                    step()
                except Exception as e:  # noqa: BLE001 - the store or storage away: next round
                    log.warning("heartbeat's %s failed: %s", name, e)
                    break
                finally:
                    took[name] = time.monotonic() - t
            if sum(took.values()) > SLOW_S:
                log.warning("slow heartbeat work (s): %s", {k: round(v, 2) for k, v in took.items()})

    def _adopt(self) -> None:
        """Take over jobs of lost DP groups (another replica's, or a node's), while this one
        serves and has room in its queue: they run again here. Each is checked on its own
        (one that cannot run here ends with the reason; the others still run)."""
        svc = self.svc
        room = svc.cfg.queue_size - svc.dispatcher.depth
        if (not svc.cfg.job_retries or svc.draining() or room <= 0
                or svc.dispatcher.availability()[0] is not Availability.SERVING):
            return
        taken = svc.store.adopt(svc.dp_group, svc.node_id, svc.model_name, room)
        for job_id, req, owner in taken:
            try:
                self._take_over(job_id, req, owner)
            except Exception as e:  # noqa: BLE001 - it is this replica's now: never left held by nobody
                log.exception("could not take over %s", job_id)
                svc.store.fail([job_id], "dp_group_lost", f"it could not run again after its DP group "
                               f"was lost: {type(e).__name__}: {str(e)[:200]}; submit it again")
        if taken:  # held or ended now (a lost answer: the store takes them back, CONFIRM_WAIT_S)
            svc.store.confirm(svc.dp_group, [job_id for job_id, _, _ in taken])

    def _take_over(self, job_id: str, req: GenerationRequest, owner: str | None) -> None:
        """Queue one adopted job: not a revoked key's; from its kept state only where this
        model can go on from it (its latents' shape and dtype, a resumable request), else from 0."""
        svc = self.svc
        if svc.revoked(owner):
            svc.store.fail([job_id], "key_revoked", "its API key was removed from the key file before "
                           "it ran again after a restart")
            return
        resumable = not svc.adapter.resume_blocker(req)  # what the rank's PipelineRunner answers
        if req.resume is not None and not (resumable and
                                           usable_state(req.resume, svc.adapter.latent_spec(req))):
            log.warning("the kept state of %s does not fit this model's run of it (shape %s, dtype %s): "
                        "it reruns from step 0", job_id, list(req.resume.shape), req.resume.dtype)
            req = req.resumed(None)
            svc.store.progress({job_id: {"resumable_step": 0}})
        svc.states.track(job_id, req)
        if svc.dispatcher.adopt(job_id, req.compat_key(), req, tenant=owner):
            log.info("took over %s from a lost DP group", job_id)
