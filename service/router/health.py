"""What the dispatcher knows of its rank groups' health: whether any can serve, why one
failed (a word for a metric label), and when a failed start is tried again. Kept apart
from the loop so these rules read, and are tested, on their own."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from service.engine.executor import GroupInfo

BACKOFF_S = (0.0, 1.0, 2.0, 4.0, 8.0)  # before the 1st, 2nd, ... retry of a failed start
BACKOFF_CAP_S = 15.0
# How a rank's collective says that a peer's process went away (gloo's TCP pair, NCCL): its
# group failed because of a death it saw first, not because of its own request.
PEER_GONE = ("connection reset by peer", "connection closed by peer", "remote process exited")


class Availability(enum.Enum):
    SERVING = "serving"  # a group is ready
    RECOVERING = "recovering"  # none is, but one is starting or about to: new jobs queue and wait
    DOWN = "down"  # none is and the last attempts failed: new jobs are refused (503 + Retry-After)


class Unavailable(Exception):
    """No group can serve and none is about to: the caller answers 503 with ``retry_after_s``."""

    def __init__(self, why: str, retry_after_s: int) -> None:
        super().__init__(why)
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[type, tuple[str, int]]:
        return type(self), (str(self), self.retry_after_s)


@dataclass
class Track:
    """The dispatcher's view of one group: ready or not, and when to try it again."""

    info: GroupInfo
    ready: bool = False
    failures: int = 0  # start/rebuild attempts failed in a row
    retry_at: float | None = None  # when the next attempt is due (None: none due)
    attempting: bool = True  # an attempt is running (the first start: from open())
    attempt_started: float = 0.0
    last_error: str | None = None


def failure_kind(why: str) -> str:
    """A word for why a group failed, for a metric label: a fixed vocabulary, never the
    free text (which may quote a request's own error, and would make label values without
    bound)."""
    lowered = why.lower()
    for word, kind in (("deadline", "deadline"), (" died", "rank_died"), ("stopped answering", "lost"),
                       *((w, "peer_lost") for w in PEER_GONE), (" failed", "rank_failed")):
        if word in lowered:
            return kind
    return "other"


def backoff_s(failures: int) -> float:
    """Wait before the attempt after ``failures`` failed ones in a row: at once, then longer."""
    return BACKOFF_S[failures - 1] if failures <= len(BACKOFF_S) else BACKOFF_CAP_S
