"""How queued requests reach the ranks: ``--scheduler``, ``--queue-size``, ``--job-retries``, ..."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .errors import FlagError

# A wave's deadline (``--wave-deadline-base-s``, ``--wave-deadline-per-forward-s``): the
# router's DeadlinePolicy and the flags take these; the scale is per forward at 832x480x81.
WAVE_DEADLINE_BASE_S = 60.0
WAVE_DEADLINE_PER_FORWARD_S = 10.0  # generous: Wan 14B at 480p is ~3 s/forward resident


@dataclass(frozen=True)
class SchedulerConfig:
    """``scheduler``: continuous (a freed rank starts the next request at the next forward) or
    waves (request-level waves of one compatibility key). ``starve_s``: continuous: a request
    queued this long goes next, whatever its cost. ``max_wait_ms``: waves: how long a partial
    wave waits. ``max_queue_wait_s``: a queued job waits at most this long for a rank.
    ``job_retries``: times the request on a rank whose process died runs again, ahead of the
    queue (the group's other requests always do); 0: none does. ``max_batch_size``: requests of
    one batch key that share each forward on a rank (continuous only; 1: one request per
    forward, as before; "auto": the cost model's cap, engine/batching.py)."""

    scheduler: Literal["continuous", "waves"] = "continuous"
    queue_size: int = 64
    starve_s: float = 30.0
    max_wait_ms: float = 50.0
    max_queue_wait_s: float = 1800.0
    job_retries: int = 1
    max_batch_size: int | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        if self.scheduler not in ("continuous", "waves"):
            raise FlagError(f"--scheduler must be continuous or waves, got {self.scheduler!r}")
        if self.job_retries < 0:
            raise FlagError(f"--job-retries must be 0 or more, got {self.job_retries}")
        if self.max_batch_size != "auto" and (isinstance(self.max_batch_size, bool)
                                              or not isinstance(self.max_batch_size, int)
                                              or self.max_batch_size < 1):
            raise FlagError(f"--max-batch-size must be auto or an integer >= 1, got {self.max_batch_size!r}")
        if not self.max_queue_wait_s > 0:
            raise FlagError(f"--max-queue-wait-s must be > 0, got {self.max_queue_wait_s}")
