"""What ranks and rank groups report to the dispatcher: one typed event, one kind enum.

A rank emits the job events (STARTED .. FINISHED, about one request); an executor adds the
group events (READY, FAILED, START_FAILED) and stamps every event with its group. Plain
data (no torch, no Ray: a step's state is bytes in a numpy array): it crosses process
boundaries by pickle.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.models.resume import StepState


class EventKind(enum.Enum):
    STARTED = "started"  # a rank took the job (text encoding begins)
    STEP = "step"  # a denoising step ended (``step`` of ``total``; ``state``: what a rerun goes on from)
    FORWARDS_DONE = "forwards_done"  # its last transformer forward ran: the rank is free again
    FINISHED = "finished"  # MP4 bytes, or an error (``cancelled`` when it was cancelled)
    REFUSED = "refused"  # the rank refused the assignment (its own re-validation)
    RANK_FAILED = "rank_failed"  # the rank cannot go on (a sticky device or collective error)
    GROUP_READY = "group_ready"  # a start or rebuild finished: the group serves
    GROUP_FAILED = "group_failed"  # a rank died, was lost or failed: every job the group holds fails
    START_FAILED = "start_failed"  # one start or rebuild attempt failed (``error`` says why)


JOB_EVENTS = frozenset({EventKind.STARTED, EventKind.STEP, EventKind.FORWARDS_DONE, EventKind.FINISHED,
                        EventKind.REFUSED})


@dataclass(frozen=True)
class Event:
    """One thing that happened. ``rank`` is the scheduler rank inside ``group`` (an SP group
    of S processes is one rank)."""

    kind: EventKind
    group: str = ""
    rank: int = 0
    job_id: str = ""
    step: int = 0
    total: int = 0
    mp4: bytes | None = field(default=None, repr=False)
    error: str | None = None
    cancelled: bool = False
    seconds: float = 0.0  # FINISHED: from the rank taking the job to its end
    timings: dict[str, float] = field(default_factory=dict)  # FINISHED: seconds per stage
    step_s: tuple[float, ...] = ()  # FINISHED: seconds of each denoising step
    state: StepState | None = field(default=None, repr=False)  # STEP of a resumable request: its latents
    preview: bytes | None = field(default=None, repr=False)  # STEP: the latents as an image (engine.preview)
    not_resumable: str = ""  # STARTED: why no state of this request is kept ("": one is, models/resume.py)
