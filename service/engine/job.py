"""A rank's job records and states: what engine/rank.py and engine/rank_batch.py share."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist

from service.models.batch import Joined
from service.models.request import GenerationRequest


class Phase(enum.Enum):
    """Where the pipeline thread is."""

    IDLE = "idle"  # no request, or between requests
    HEAD = "head"  # text encoding and set-up before the first forward
    GATE = "gate"  # a forward is waiting for the tick that lets it run
    FORWARD = "forward"  # a forward is running (its gathers with the group's)
    BETWEEN = "between"  # between two forwards of one request (scheduler step, CFG)
    TAIL = "tail"  # all forwards done: VAE decode, then the frames go to the encoder


@dataclass(frozen=True)
class Job:
    """One request assigned to this rank."""

    id: str
    req: GenerationRequest
    plan: tuple[int, ...] = ()  # the expert of each forward (two-expert models only)


@dataclass
class Member:
    """A job of the running batch (``RankWorker._drive``): its own thread runs its pipeline."""

    job: Job
    denoiser: Joined
    expected: int  # forwards it makes
    marks: dict[str, float]
    done: int = 0  # forwards it took part in
    most: int = 1  # the most requests that shared one of its forwards (timings.batch_size)


class JobCancelled(Exception):
    """Raised in the pipeline thread at a forward boundary the tick thread chose."""


def sticky_error(e: BaseException) -> bool:
    """Whether an error leaves the rank unusable: the CUDA context (an illegal access, ECC,
    a launch failure: every later call fails too) or the process group (a collective that
    failed leaves the ranks out of step)."""
    if isinstance(e, dist.DistError):
        return True
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(e, accel):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        m in text for m in ("CUDA error", "CUBLAS_STATUS", "NCCL error", "cudaError", "device-side assert"))
