"""Whether the results storage takes writes: a failed write turns the replica not-ready.

A full disk (or a read-only mount, or an object store that refuses) fails every job the
replica would accept: their records cannot be written, nor their videos. So the first
``StorageError`` makes ``/readyz`` answer 503 (a balancer sends work elsewhere), new jobs get
507 with Retry-After before any work, the gauge ``dloserve_storage_ready{group}`` drops to 0
(the DloserveStorageFailing alert), and a probe write of the size that failed, every
``PROBE_EVERY_S`` from the heartbeat thread, clears it once there is room again.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from typing import Any

from service.api.results import ResultStorage, StorageError
from service.api.views import redact
from service.engine.metrics import metrics

log = logging.getLogger("dloserve.api")
PROBE_EVERY_S = 5.0
PROBE_MAX_BYTES = 16 << 20
RETRY_AFTER_S = 60


def cause_of(e: BaseException) -> BaseException:
    """The storage's own error (a job-store actor's arrives wrapped in Ray's RayTaskError)."""
    return getattr(e, "cause", None) or e


class StorageHealth:
    """The replica's view of its results storage: fine, or failing since when and why."""

    def __init__(self, storage: ResultStorage, group: str) -> None:
        self.storage, self.group = storage, group
        self._lock = threading.Lock()
        self._trouble: dict[str, Any] | None = None  # why, since, the size of the write that failed
        self._probed = 0.0

    def failed(self, e: BaseException, nbytes: int) -> None:
        """A write failed: not ready until a probe of ``nbytes`` succeeds."""
        cause = cause_of(e)
        code = getattr(cause, "errno", None)
        kind = errno.errorcode.get(code, "EIO") if isinstance(code, int) else "EIO"
        with self._lock:
            first = self._trouble is None
            self._trouble = {"error": redact(str(cause)), "errno": kind, "since": time.time(),
                             "bytes": max(nbytes, self._trouble["bytes"] if self._trouble else 0)}
            self._probed = time.monotonic()
        self.report()
        if first:
            log.error("results storage failing (%s): not ready until a write succeeds", cause)

    def report(self) -> None:
        """The gauge: 1 while writes go through (set at every heartbeat: Prometheus sees it)."""
        metrics()["storage_ready"].set(0 if self.problem() else 1, tags={"group": self.group})

    def problem(self) -> dict[str, Any] | None:
        """``{error, errno, since}`` while writes fail, else None."""
        with self._lock:
            return None if self._trouble is None else {k: v for k, v in self._trouble.items() if k != "bytes"}

    def refuse(self) -> None:
        """StorageError now, before any work, while writes fail (the API's 507)."""
        trouble = self.problem()
        if trouble is not None:
            raise StorageError(getattr(errno, trouble["errno"], errno.EIO),
                               f"{trouble['error']}; new jobs are refused until it takes writes again")

    def probe(self) -> None:
        """From the heartbeat thread: try a write of the failed size now and then; clear on success."""
        self.report()
        with self._lock:
            if self._trouble is None or time.monotonic() - self._probed < PROBE_EVERY_S:
                return
            self._probed = time.monotonic()
            nbytes = min(int(self._trouble["bytes"]), PROBE_MAX_BYTES)
        try:
            self.storage.probe(nbytes)
        except OSError as e:
            log.warning("results storage still failing: %s", e)
            return
        with self._lock:
            self._trouble = None
        self.report()
        log.warning("results storage takes writes again: ready")
