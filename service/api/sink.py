"""The dispatcher's Sink for the HTTP service: job state into the job store, videos into the
results storage.

Called from the dispatcher thread, which must get back to scheduling at once: progress and
previews are buffered and sent by the heartbeat (``flush``); a status change (started, queued
again, not resumable) is written by one thread of its own, in order; storing a video (an
upload, with S3) and its final record run on a small pool of their own, each after its job's
status changes. The dispatcher calls these holding its lock, which admission takes too: four
starts whose record writes took 1 s each held a POST for 3.8 s while they were written there.
A storage that refuses a write fails that job with a reason and marks the replica not ready
(storage_health.py); it never crashes the dispatcher thread (every held job would fail).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from service.api.durable import StateKeeper
from service.api.records import JobStatus
from service.api.results import ResultStorage, StorageError
from service.api.storage_health import StorageHealth
from service.api.store import JobTable
from service.api.views import redact
from service.engine.metrics import metrics
from service.engine.outcome import Outcome
from service.router.queue import Ticket

log = logging.getLogger("dloserve.api")


class JobSink:
    """One DP group's job events, written where clients read them."""

    def __init__(self, store: JobTable, storage: ResultStorage, storage_health: StorageHealth,
                 states: StateKeeper, dp_group: str) -> None:
        self.store, self.storage, self.storage_health = store, storage, storage_health
        self.states, self.dp_group = states, dp_group
        # per job: progress and resumable_step, and the latest preview, until the next flush
        self._progress: dict[str, dict[str, int]] = {}
        self._previews: dict[str, tuple[int, bytes]] = {}
        self._lock = threading.Lock()
        self._finisher = ThreadPoolExecutor(2, thread_name_prefix="dloserve-finish")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="dloserve-records")  # one: in order

    def flush(self) -> None:
        """Send the buffered progress and previews to the store (the heartbeat's call)."""
        with self._lock:
            progress, self._progress = self._progress, {}
            previews, self._previews = self._previews, {}
        if progress:
            self.store.progress(progress)
        if previews:
            self.store.put_previews(previews)

    def close(self) -> None:
        """Every status change and outcome handed over so far is stored when this returns."""
        self._writer.shutdown(wait=True)
        self._finisher.shutdown(wait=True)

    # -- Sink: called from the dispatcher thread ---------------------------------------
    def on_start(self, ticket: Ticket, info: dict[str, Any]) -> None:
        self._update(ticket.id, status=JobStatus.IN_PROGRESS, wave=info["wave"], dp_rank=info["rank"],
                     resumed_from_step=info.get("resumed_from_step", 0))

    def on_not_resumable(self, ticket_id: str, why: str) -> None:
        """Its rank keeps no state of it: a rerun would start from step 0, for this reason."""
        self._update(ticket_id, not_resumable=why)

    def on_progress(self, ticket_id: str, step: int, total: int) -> None:
        with self._lock:
            self._progress.setdefault(ticket_id, {})["progress"] = min(99, int(100 * step / max(1, total)))

    def on_preview(self, ticket_id: str, step: int, total: int, image: bytes) -> None:
        with self._lock:
            self._previews[ticket_id] = (step, image)

    def on_state(self, ticket_id: str, state: Any) -> None:
        self.states.offer(ticket_id, state)
        # The dispatcher keeps it now: say so (a client, or a test that kills the rank, can
        # know the rerun's starting point; progress alone runs ahead of the kept state).
        with self._lock:
            self._progress.setdefault(ticket_id, {})["resumable_step"] = state.step

    def on_requeue(self, ticket: Ticket, why: str) -> None:
        self.states.urgent(ticket.id)  # paused or its group failed: its step is kept now
        with self._lock:
            pending = self._progress.pop(ticket.id, {})
        kept = {"resumable_step": pending["resumable_step"]} if "resumable_step" in pending else {}
        self._update(ticket.id, status=JobStatus.QUEUED, progress=0, wave=None, dp_rank=None,
                     preemptions=ticket.preemptions, **kept)

    def on_finish(self, ticket: Ticket, outcome: Outcome, info: dict[str, Any]) -> None:
        try:
            self._finisher.submit(self._finish, ticket, outcome)
        except RuntimeError:  # shut down (after a drain): store it here
            self._finish(ticket, outcome)

    def _update(self, job_id: str, **fields: Any) -> None:
        """A status change from the dispatcher thread, written by the writer thread."""
        try:
            self._writer.submit(self._write, job_id, fields)
        except RuntimeError:  # shut down (after a drain): write it here
            self._write(job_id, fields)

    def _write(self, job_id: str, fields: dict[str, Any]) -> None:
        """A storage that refuses the write must not end the job: the store keeps it in memory;
        the store away: logged (the heartbeat's next beat finds out the same)."""
        try:
            self.store.update(job_id, **fields)
        except StorageError as e:
            log.warning("could not write the record of %s: %s", job_id, e)
            self.storage_health.failed(e, 4096)
        except Exception:  # noqa: BLE001 - the store unreachable: this change is lost, the job goes on
            log.exception("could not send the status change of %s to the job store", job_id)

    def _finish(self, ticket: Ticket, outcome: Outcome) -> None:
        try:
            self._store_outcome(ticket, outcome)
        except Exception as e:  # noqa: BLE001 - the storage failed: the job fails with a reason
            log.exception("could not store the outcome of %s", ticket.id)
            if isinstance(e, StorageError):
                self.storage_health.failed(e, len(outcome.mp4 or b""))
            err = {"code": "storage_failed", "message": "the result could not be stored; submit it again"}
            try:
                self.store.finish(ticket.id, by=self.dp_group, status=JobStatus.FAILED, error=err)
            except Exception:  # noqa: BLE001 - the store is unreachable too
                log.exception("could not fail %s", ticket.id)

    def _store_outcome(self, ticket: Ticket, outcome: Outcome) -> None:
        try:  # the status changes handed over before it land before its end (one writer, in order)
            self._writer.submit(lambda: None).result()
        except RuntimeError:  # shut down: they are written already
            pass
        self.states.forget(ticket.id)  # no state of it is written after its end (the store drops them)
        with self._lock:
            self._progress.pop(ticket.id, None)
            last = self._previews.pop(ticket.id, None)
        if last is not None:  # its last step's preview is in the store before its end is
            self.store.put_previews({ticket.id: last})
        t0 = time.monotonic()
        held = self.store.get(ticket.id)
        if held is not None and (held.dp_group not in (None, self.dp_group)
                                 or (held.dp_group is None and not outcome.ok)):
            # This group was declared lost: another took the job over, or will (only a
            # finished video of ours may still end it then; a failure or our cancel may not).
            log.warning("job %s ended here after this group was declared lost; output dropped", ticket.id)
            return
        if outcome.ok:
            assert outcome.mp4 is not None
            self.storage.write_video(ticket.id, outcome.mp4)  # the video lands before the status
            fields: dict[str, Any] = {"status": JobStatus.COMPLETED, "progress": 100,
                                      "dp_rank": outcome.dp_rank}
        elif outcome.cancelled:
            fields = {"status": JobStatus.CANCELLED,
                      "error": {"code": "cancelled", "message": "cancelled (DELETE) while it ran"}}
        else:
            # A group's failure reason may quote the request that caused it: name no other job.
            message = redact(outcome.error, ticket.id) or "unknown error"
            fields = {"status": JobStatus.FAILED, "error": {"code": "generation_failed", "message": message}}
        timings = dict(outcome.timings)
        if timings:
            timings["store_s"] = time.monotonic() - t0
        ended = self.store.finish(ticket.id, by=self.dp_group, timings=timings or None, **fields)
        status = fields["status"].value
        if ended is None:  # deleted meanwhile, ended already, or another group's now (this one was lost)
            now = self.store.get(ticket.id)
            log.warning("job %s ended (%s) here after its record was %s; output dropped", ticket.id, status,
                        "deleted" if now is None else f"{now.status.value} by {now.dp_group}")
            if outcome.ok and (now is None or (now.final and now.status is not JobStatus.COMPLETED)):
                self.storage.remove(f"{ticket.id}.mp4")  # (the same bytes another group may write)
            return
        metrics()["requests"].inc(1, tags={"status": status})
        observe_stages(timings)
        latency = max(0.0, time.time() - ended.created_at)
        metrics()["request_latency"].observe(latency, tags={"status": status})


def observe_stages(timings: dict[str, Any]) -> None:
    """Each stage's seconds into the ``dloserve_stage_seconds`` histogram."""
    for key, value in timings.items():
        if key.endswith("_s") and key != "step_s" and isinstance(value, int | float):
            metrics()["stage"].observe(float(value), tags={"stage": key[:-2]})
