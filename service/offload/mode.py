"""How the transformer's weights reach the device: the one mode enum, and what ``auto``
resolved to (plain data, no torch: the flag parsers and every layer above speak it)."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any


class OffloadMode(enum.StrEnum):
    """``--dlo-mode``'s values, plus RESIDENT (no offload) and AUTO (resolved at load). A string
    enum: it is its flag value in JSON, logs and comparisons."""

    RESIDENT = "resident"  # no offload: the whole transformer lives on the device
    ALLGATHER = "allgather"  # 1/N host shards per rank, each block rebuilt by an AllGather
    RANK_LOCAL = "rank-local"  # every rank streams whole blocks itself: no collectives
    AUTO = "auto"  # ALLGATHER or RANK_LOCAL, chosen at load from a probe forward

    @property
    def streams(self) -> bool:
        """Whether the transformer streams from host memory (AUTO: it will, either way)."""
        return self is not OffloadMode.RESIDENT

    @property
    def gathers(self) -> bool:
        """Whether ranks rebuild blocks from each other's shards (AUTO: not known yet)."""
        if self is OffloadMode.AUTO:
            raise ValueError("--dlo-mode auto is not resolved yet (the probe chooses)")
        return self is OffloadMode.ALLGATHER


STREAMED = (OffloadMode.ALLGATHER, OffloadMode.RANK_LOCAL)  # what a handle runs in, and auto picks


def streamed_mode(mode: OffloadMode | str) -> OffloadMode:
    """``mode`` as one a layerwise handle can run in; ValueError for resident or unresolved auto."""
    m = OffloadMode(mode)
    if m not in STREAMED:
        raise ValueError(f"a layerwise handle runs allgather or rank-local, not {m.value}")
    return m


@dataclass(frozen=True)
class ProbeTimings:
    """What the probe measured on one rank (or the worst over the group). Seconds, bytes/s."""

    world: int
    block_bytes: int  # bytes of one streamed block (the largest)
    compute_s: float  # one block's forward at the probe workload
    h2d_bps: float  # pinned host -> device (what a shard fill runs at)
    ranklocal_bps: float  # rank-local source -> device (page cache DMA, or pack + H2D)
    gather_bps: float | None  # AllGather output bytes/s; None: not measured (taken as free)
    ranklocal_source: str = "pack"
    activation_bytes: int = 0  # device peak of the probe forward beyond weights (CUDA)


@dataclass(frozen=True)
class ModeChoice:
    """What ``--dlo-mode auto`` resolved to and why: the one typed result every layer passes
    up (logs, /readyz's ``offload_mode``, ``generate``'s summary). The predictions and timings
    are None when no probe ran (the reason says why)."""

    mode: OffloadMode  # ALLGATHER or RANK_LOCAL
    reason: str
    allgather_s: float | None = None  # predicted time per block
    ranklocal_s: float | None = None
    timings: ProbeTimings | None = None
    source: str | None = None  # "rule" (no probe needed), "probe" (measured now) or "cached"

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", streamed_mode(self.mode))

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON (``mode`` as its flag value)."""
        d = asdict(self)
        d["mode"] = self.mode.value
        return {k: v for k, v in d.items() if v is not None}

