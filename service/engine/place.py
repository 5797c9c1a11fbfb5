"""Where a rank process sits and what it gets there (its MP4 encoder pool), without torch:
``dloserve serve`` imports this (and engine.standby) to start the rank processes before
Serve, and importing torch there would put its seconds on the start's critical path."""

from __future__ import annotations

import os
from dataclasses import dataclass

from service.config import EngineConfig

from .encoder import Encoder, pool_size

NAMESPACE = "dloserve"  # the Ray namespace of the rank processes (named actors)


@dataclass(frozen=True)
class RankPlace:
    """Where one rank process sits: process ``rank`` of the ``world`` processes of group
    ``group_id``, whose first process is ``first`` among the engine's (for metrics and logs)."""

    group_id: str
    rank: int
    world: int
    first: int = 0

    @property
    def lead(self) -> bool:
        """Reports its request's MP4: every rank of a DP group (each runs its own request);
        in an SP group (one request on S processes) only process 0."""
        return self.rank == 0

    @property
    def label(self) -> str:
        return str(self.first + self.rank)


def rank_encoder(config: EngineConfig, place: RankPlace) -> Encoder:
    """The rank's MP4 encoder pool (its processes start now): only the lead of an SP group
    encodes."""
    return Encoder(config.parallel.encoders_per_rank if config.parallel.sp_size == 1 or place.lead else 0)


def rank_encoder_count(config: EngineConfig, place: RankPlace) -> int:
    """The MP4 encoders process ``place`` gets: ``--encoders-per-rank``, else what a rank of
    ``cpus_per_rank`` CPUs sizes for itself (engine.encoder.pool_size); 0 off an SP lead."""
    if config.parallel.sp_size > 1 and not place.lead:
        return 0
    if config.parallel.encoders_per_rank is not None:
        return config.parallel.encoders_per_rank
    return pool_size(min(config.parallel.cpus_per_rank, len(os.sched_getaffinity(0))))
