"""LoRA adapters on the ranks: ``--lora-cache-gb`` (docs/lora.md)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import FlagError


@dataclass(frozen=True)
class LoraConfig:
    """``cache_gb``: device memory for adapter weights, an LRU of whole adapters (0: no
    adapters), counted by ``--dlo-device-memory-gb``."""

    cache_gb: float = 2.0

    def __post_init__(self) -> None:
        if isinstance(self.cache_gb, bool) or not 0 <= float(self.cache_gb) < float("inf"):
            raise FlagError(f"--lora-cache-gb must be >= 0, got {self.cache_gb!r}")

    @property
    def cache_bytes(self) -> int:
        return int(self.cache_gb * 2**30)
