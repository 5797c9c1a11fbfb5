"""One job's record: the typed shape every part of the api package passes around.

The job store keeps these, the results storage persists them as JSON (``to_json``), and
the public video object is made from one (``schemas.Video``). ``owner`` and the placement
fields are private: they never reach a caller.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any


class JobStatus(enum.Enum):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"  # stopped by DELETE while it ran (the video object says "failed")

    @property
    def final(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)


@dataclass(frozen=True)
class JobRecord:
    id: str
    created_at: int
    status: JobStatus = JobStatus.QUEUED
    progress: int = 0
    model: str = ""
    prompt: str = ""
    seconds: str = "0"
    size: str = ""
    seed: int = 0
    num_frames: int = 0
    fps: int = 0
    num_inference_steps: int = 0
    guidance_scale: float = 0.0
    loras: list[dict[str, Any]] = field(default_factory=list)  # as asked: [{"name", "scale", "expert"?}]
    cache: dict[str, Any] | None = None  # the request's own step cache (None: the server's default)
    owner: str | None = None  # the API key's id: who may see it
    dp_group: str | None = None  # the replica (DP group) that runs it
    node_id: str | None = None  # and its Ray node
    wave: int | None = None
    dp_rank: int | None = None
    resumed_from_step: int = 0  # the run now (or last) going on from this step of an earlier one
    resumable_step: int = 0  # the last step whose state the service keeps: a rerun goes on from it
    not_resumable: str = ""  # why it keeps none ("": it does, or no rank has said yet)
    priority: int = 0  # lower is served first
    preemptions: int = 0  # times it was paused for a better-priority request (it went on from its step)
    error: dict[str, Any] | None = None  # {"code", "message"}
    completed_at: int | None = None
    expires_at: int | None = None
    timings: dict[str, Any] | None = None  # seconds per stage (see docs/operate.md)
    created: float = 0.0  # created_at to the microsecond: lists order jobs made in one second
    extra: dict[str, Any] = field(default_factory=dict)  # what a newer version stored

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", JobStatus(self.status))

    @property
    def final(self) -> bool:
        return self.status.final

    def with_(self, **changes: Any) -> JobRecord:
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> JobRecord:
        """A stored record; keys this version does not know are kept in ``extra``."""
        known = {f.name for f in fields(cls)}
        extra = {k: v for k, v in d.items() if k not in known}
        return cls(**{k: v for k, v in d.items() if k in known and k != "extra"},
                   extra={**d.get("extra", {}), **extra})
