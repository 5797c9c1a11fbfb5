"""How one request ended (Outcome): plain data, shared by the executors, the dispatcher and
the front ends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Outcome:
    """How one request ended: MP4 bytes, or an error naming the reason."""

    dp_rank: int
    mp4: bytes | None = None
    error: str | None = None
    seconds: float = 0.0
    stats: dict[str, Any] | None = None
    cancelled: bool = False
    timings: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.mp4 is not None and self.error is None
