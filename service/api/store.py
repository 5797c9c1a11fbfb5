"""Bounded job store: one JSON record and one MP4 per job in a local folder.

Records are written through to disk (atomic rename) so a restarted replica, another
replica on the same node, or a shared mount (NFS, a bucket through a FUSE driver) sees
the same jobs. To keep results elsewhere, point ``root`` at such a mount or subclass
``JobStore`` and override ``_write_blob``/``open_content``/``_drop``. Retention: finished
jobs expire after ``ttl_s`` and only the newest ``max_jobs`` are kept.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

FINAL = ("completed", "failed")


class StoreLocked(RuntimeError):
    """Another live process owns this results folder."""


def lock_folder(root: Path) -> Any:
    """An exclusive lock on ``root`` held for the life of the returned file (flock: the
    kernel drops it when the process dies, so a crashed instance never blocks the next)."""
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    f = open(root / ".lock", "a+")  # noqa: SIM115 - held open on purpose
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise StoreLocked(f"results folder {root} is in use by {holder}; give this instance its own "
                          "with --results-dir") from None
    f.truncate(0)
    f.write(f"pid {os.getpid()}")
    f.flush()
    return f


class JobStore:
    """Thread-safe: the HTTP handlers read while the dispatcher thread writes.

    ``exclusive`` locks the folder for this process: one instance never changes another
    live instance's jobs (replicas that share a folder on purpose pass False).
    """

    def __init__(self, root: str | os.PathLike, ttl_s: float = 86400.0, max_jobs: int = 1000,
                 exclusive: bool = False):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_file = lock_folder(self.root) if exclusive else None
        self.ttl_s = ttl_s
        self.max_jobs = max_jobs
        self._jobs: dict[str, dict[str, Any]] = {}
        self._lock = threading.RLock()
        for f in self.root.glob("*.json"):  # adopt what a previous process left
            try:
                rec = json.loads(f.read_text())
                self._jobs[rec["id"]] = rec
            except (OSError, ValueError, KeyError):
                continue

    def put(self, rec: dict[str, Any]) -> None:
        with self._lock:
            self._jobs[rec["id"]] = rec
            self._flush(rec)
            self._prune()

    def get(self, job_id: str) -> dict[str, Any] | None:
        with self._lock:
            rec = self._jobs.get(job_id)
            if rec is None:
                rec = self._load(job_id)
            return dict(rec) if rec else None

    def update(self, job_id: str, **fields: Any) -> dict[str, Any] | None:
        with self._lock:
            rec = self._jobs.get(job_id)
            if rec is None:
                return None
            rec.update(fields)
            self._flush(rec)
            return dict(rec)

    def finish(self, job_id: str, mp4: bytes | None, **fields: Any) -> None:
        """Store the output (if any) and the final state; the MP4 lands before the status."""
        if mp4 is not None:
            self._write_blob(job_id, mp4)
        fields.setdefault("completed_at", int(time.time()))
        fields["expires_at"] = int(fields["completed_at"] + self.ttl_s)
        self.update(job_id, **fields)
        with self._lock:
            self._prune()

    def fail_unfinished(self, code: str, message: str) -> int:
        """End every queued/in-progress job as failed (after a restart); returns how many."""
        with self._lock:
            ids = [r["id"] for r in self._jobs.values() if r.get("status") not in FINAL]
        for job_id in ids:
            self.finish(job_id, None, status="failed", error={"code": code, "message": message})
        return len(ids)

    def delete(self, job_id: str) -> bool:
        with self._lock:
            found = self._jobs.pop(job_id, None) is not None or self._path(job_id).exists()
            self._drop(job_id)
            return found

    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            return sorted((dict(r) for r in self._jobs.values()), key=lambda r: r["created_at"])

    def content_path(self, job_id: str) -> Path | None:
        p = self.root / f"{job_id}.mp4"
        return p if p.is_file() else None

    # -- storage -----------------------------------------------------------------------
    def _path(self, job_id: str) -> Path:
        return self.root / f"{job_id}.json"

    def _flush(self, rec: dict[str, Any]) -> None:
        tmp = self.root / f".{rec['id']}.json.tmp"
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, self._path(rec["id"]))

    def _load(self, job_id: str) -> dict[str, Any] | None:
        if not job_id.replace("_", "").replace("-", "").isalnum():
            return None  # never build paths from arbitrary input
        try:
            return json.loads(self._path(job_id).read_text())
        except (OSError, ValueError):
            return None

    def _write_blob(self, job_id: str, data: bytes) -> None:
        tmp = self.root / f".{job_id}.mp4.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.root / f"{job_id}.mp4")

    def _drop(self, job_id: str) -> None:
        for p in (self._path(job_id), self.root / f"{job_id}.mp4"):
            p.unlink(missing_ok=True)

    def _prune(self) -> None:
        now = time.time()
        done = sorted(
            (r for r in self._jobs.values() if r.get("status") in FINAL),
            key=lambda r: r.get("completed_at") or r["created_at"],
        )
        expired = [r for r in done if (r.get("expires_at") or now + 1) <= now]
        excess = max(0, len(self._jobs) - len(expired) - self.max_jobs)
        for r in expired + [r for r in done if r not in expired][:excess]:
            self._jobs.pop(r["id"], None)
            self._drop(r["id"])
