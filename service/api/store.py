"""The job table: every job's record, its retention, and who (which DP group) holds it.

``JobTable`` is also the store interface: the job-store actor (``service.api.jobs``) is a
JobTable with heartbeats, and the replicas' client forwards these same methods to it, so
a test (or one process) can use a JobTable directly where a service expects a store.

One process owns a table (the job-store actor in ``service.api.jobs``): it is the single
writer for its storage URL, so create/get/list/delete and progress read the same from any
replica on any node. Records are written through to the storage (``ResultStorage``) on
every state change, so the actor's restart (or a new cluster on the same URL) reloads them;
progress alone stays in memory (one write per denoising step would be wasteful on S3).

Retention: finished jobs expire after ``ttl_s`` and only the newest ``max_jobs`` are kept.
A final record is final: a late update from a group that was declared dead cannot revive it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service.api.records import JobRecord, JobStatus
from service.api.results import ResultStorage, safe_id

log = logging.getLogger("dloserve.store")


class StoreLocked(RuntimeError):
    """Another live process owns this results folder."""


def lock_folder(root: Path) -> Any:
    """An exclusive lock on ``root`` held for the life of the returned file (flock: the
    kernel drops it when the process dies, so a crashed instance never blocks the next)."""
    import fcntl

    root.mkdir(mode=0o700, parents=True, exist_ok=True)  # its records are private
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)  # its pid: private too
    os.fchmod(fd, 0o600)  # (one an older version made 0644)
    f = os.fdopen(fd, "r+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise StoreLocked(f"results folder {root} is in use by {holder}; give this instance its own "
                          "with --results-url") from None
    f.seek(0)
    f.truncate(0)
    f.write(f"pid {os.getpid()}")
    f.flush()
    return f


STEP_FIELDS = ("progress", "resumable_step")  # what ``progress`` may change


class JobTable:
    """Thread-safe records over a ResultStorage; ``exclusive`` locks a local folder."""

    def __init__(self, storage: ResultStorage, ttl_s: float = 86400.0, max_jobs: int = 1000,
                 exclusive: bool = False) -> None:
        self.storage = storage
        self.ttl_s = ttl_s
        self.max_jobs = max_jobs
        self._lock_file = (lock_folder(storage.local_path)
                           if exclusive and storage.local_path is not None else None)
        self._lock = threading.RLock()
        self._jobs: dict[str, JobRecord] = {}
        if self._lock_file is not None:  # the folder's one owner: a killed writer's temp files go
            storage.sweep_tmp()
        self.on_final: Callable[[JobRecord], None] | None = None  # each record that becomes final, once
        self._previews: dict[str, tuple[int, bytes, str]] = {}  # job -> (step, image, etag): memory only
        for d in storage.read_records():
            try:
                rec = JobRecord.from_json(d)
            except Exception as e:  # noqa: BLE001 - one record never stops a start
                log.warning("job record %s skipped: %s", d.get("id"), str(e)[:200] or type(e).__name__)
                continue  # a record this version cannot read: not a job it knows
            self._jobs[rec.id] = rec

    def put(self, rec: JobRecord) -> None:
        """Record a new job; StorageError (and no record) when its write fails."""
        with self._lock:
            self.storage.write_record(rec.to_json())
            self._jobs[rec.id] = rec
            self._prune()

    def get(self, job_id: str) -> JobRecord | None:
        with self._lock:
            return self._jobs.get(job_id)

    def update(self, job_id: str, persist: bool = True, **fields: Any) -> JobRecord | None:
        """Change a live job; a final one is left as it is (and returned as it is)."""
        with self._lock:
            rec = self._jobs.get(job_id)
            if rec is None or rec.final:
                return rec
            rec = self._jobs[job_id] = rec.with_(**fields)
            if persist:
                self.storage.write_record(rec.to_json())
            return rec

    def progress(self, updates: dict[str, dict[str, int]]) -> None:
        """Several jobs' per-step fields at once (``progress``, ``resumable_step``): kept in
        memory, not worth a write each."""
        for job_id, fields in updates.items():
            self.update(job_id, persist=False, **{k: v for k, v in fields.items() if k in STEP_FIELDS})

    def put_previews(self, updates: dict[str, tuple[int, bytes]]) -> None:
        """Several jobs' latest preview images (kept in memory, like progress; a finished job
        keeps its last one until the job goes)."""
        with self._lock:
            for job_id, (step, data) in updates.items():
                if job_id in self._jobs:
                    self._previews[job_id] = (step, data, hashlib.sha256(data).hexdigest()[:20])

    def preview(self, job_id: str) -> tuple[int, bytes, str] | None:
        """(step, image bytes, etag) of the job's latest preview, or None."""
        with self._lock:
            return self._previews.get(job_id)

    def finish(self, job_id: str, by: str | None = None, **fields: Any) -> JobRecord | None:
        """End a job (its video, if any, is already stored): its final record, or None if it
        is gone, had ended already, or (``by``: the DP group that ran it) is another group's
        now (``by`` was declared lost and another took the job over; a job no group holds yet
        may still be ended by the group that lost it, which was only silent)."""
        with self._lock:
            rec = self._jobs.get(job_id)
            if rec is None or rec.final or (by is not None and rec.dp_group not in (None, by)):
                return None
            fields.setdefault("completed_at", int(time.time()))
            fields["expires_at"] = int(fields["completed_at"] + self.ttl_s)
            rec = rec.with_(**fields)
            if not rec.final:
                raise ValueError(f"finish() needs a final status, got {rec.status.value}")
            self._jobs[job_id] = rec
            self.storage.write_record(rec.to_json())
            self._prune()
        if self.on_final is not None:
            try:
                self.on_final(rec)  # webhooks: queued, never blocking
            except Exception:  # noqa: BLE001 - an announcement never undoes the end
                log.exception("on_final for %s failed", job_id)
        return rec

    def fail(self, ids: list[str], code: str, message: str) -> int:
        """Fail these jobs if still live; returns how many were."""
        err = {"code": code, "message": message}
        return sum(self.finish(i, status=JobStatus.FAILED, error=err) is not None for i in ids)

    def unfinished(self, dp_group: str | None = None) -> list[str]:
        with self._lock:
            return [r.id for r in self._jobs.values() if not r.final
                    and (dp_group is None or r.dp_group == dp_group)]

    def live_groups(self) -> set[str]:
        """DP groups that hold unfinished jobs."""
        with self._lock:
            return {str(r.dp_group) for r in self._jobs.values() if not r.final and r.dp_group}

    def delete(self, job_id: str) -> bool:
        if not safe_id(job_id):
            return False
        with self._lock:
            found = self._jobs.pop(job_id, None) is not None
            self._previews.pop(job_id, None)
            self.storage.drop(job_id)
            return found

    def list(self) -> list[JobRecord]:
        with self._lock:
            return sorted(self._jobs.values(), key=lambda r: (r.created_at, r.created, r.id))

    def page(self, owner: str | None, by_owner: bool, after: str | None, limit: int,
             order: str) -> tuple[list[JobRecord], bool]:
        """One page of jobs (OpenAI's ``after``/``limit``/``order``), the caller's only when
        ``by_owner``; the flag says whether more follow."""
        recs = self.list()
        if by_owner:
            recs = [r for r in recs if r.owner == owner]
        if order == "desc":
            recs.reverse()
        if after:
            ids = [r.id for r in recs]
            recs = recs[ids.index(after) + 1 :] if after in ids else []
        return recs[:limit], len(recs) > limit

    def _prune(self) -> None:
        now = time.time()
        done = sorted((r for r in self._jobs.values() if r.final),
                      key=lambda r: r.completed_at or r.created_at)
        expired = [r for r in done if (r.expires_at or now + 1) <= now]
        excess = max(0, len(self._jobs) - len(expired) - self.max_jobs)
        for r in expired + [r for r in done if r not in expired][:excess]:
            self._jobs.pop(r.id, None)
            self._previews.pop(r.id, None)
            self.storage.drop(r.id)
