"""What an engine is built from (EngineSpec) and how one request ended (Outcome): plain data,
shared by the driver's groups, the dispatcher and the front ends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EngineSpec:
    """How to build the rank groups of one ingress replica or batch job."""

    model_dir: str
    dp_size: int = 1
    offload: bool = True
    use_allgather: bool = True
    offload_options: dict[str, Any] = field(default_factory=dict, hash=False)  # models.options
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0
    strategy: str = "STRICT_PACK"
    pg_timeout_s: float = 3600.0  # last resort: request deadlines tear a group down first
    setup_timeout_s: float = 900.0
    encoders_per_rank: int | None = None  # None: sized from the rank's CPUs (engine.encoder)
    sp_size: int = 1  # sequence parallel: each of the dp_size groups is S actors

    def bundles(self) -> list[dict[str, float]]:
        """One bundle per actor (D x S); a Serve replica with 0 CPUs rides in bundle 0."""
        b: dict[str, float] = {"CPU": self.cpus_per_rank}
        if self.gpus_per_rank:
            b["GPU"] = self.gpus_per_rank
        return [dict(b) for _ in range(self.dp_size * self.sp_size)]

    @property
    def device(self) -> str:
        return "cuda" if self.gpus_per_rank else "cpu"

    @property
    def collective(self) -> bool:
        """Whether the ranks gather weights from each other (and so must tick together)."""
        return self.offload and self.use_allgather and self.dp_size > 1

    def group_layout(self) -> list[tuple[int, int]]:
        """(first bundle, size) of each group: one AllGather group, N single ranks, or D SP
        groups (each one scheduler rank over S bundles)."""
        if self.sp_size > 1:
            return [(d * self.sp_size, 1) for d in range(self.dp_size)]
        if self.collective:
            return [(0, self.dp_size)]
        return [(r, 1) for r in range(self.dp_size)]


@dataclass
class Outcome:
    """How one request ended: MP4 bytes, or an error naming the reason."""

    dp_rank: int
    mp4: bytes | None = None
    error: str | None = None
    seconds: float = 0.0
    stats: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.mp4 is not None and self.error is None
