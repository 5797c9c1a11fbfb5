"""How many ranks, and where they run: ``--data-parallel-size``, ``--sequence-parallel-size``,
``--cpus-per-rank``, ``--gpus-per-rank``, ``--placement-strategy``, ``--encoders-per-rank``,
``--rank-standby``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .errors import FlagError

INGRESS_CPUS = 2  # left to the ingress (body parsing, image checks), the proxy and Ray's daemons
CPUS_PER_RANK = 1.0  # the default where the host is not ours to size (a cluster we join)
STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


def host_cpus_per_rank(node_cpus: float, ranks: int) -> tuple[float, str]:
    """The CPUs each rank gets by default on a node we own, and why: the node's, less what the
    ingress needs, shared by the ``ranks`` on it; whole CPUs, never below ``CPUS_PER_RANK``
    (so a small host places its ranks as before). A rank's CPUs size its MP4 encoder pool
    (engine.encoder.pool_size): on a 16-core host one rank gets 14, three encoders, not one."""
    share = float(int((node_cpus - INGRESS_CPUS) // max(1, ranks)))
    value = max(CPUS_PER_RANK, share)
    return value, (f"from the host: {node_cpus:g} CPUs less {INGRESS_CPUS} for the ingress, over "
                   f"{ranks} rank{'s' if ranks != 1 else ''} (--cpus-per-rank sets it)")


@dataclass(frozen=True)
class ParallelConfig:
    """``dp_size`` groups (or ranks) of ``sp_size`` processes each, one bundle per process.

    ``encoders_per_rank``: MP4 encoders per rank; None: from its CPUs (engine.encoder).
    ``rank_standby``: a pre-imported process per rank waits to replace it (engine.standby); None:
    on GPU ranks. ``rank_standby_preload``: a standby
    of a one-process group loads the pipeline while it waits, so it takes over without the load
    and the compile warm-up (engine.standby). ``executor``: which transport runs the ranks
    (``dloserve generate``: local). ``pg_timeout_s`` is the last resort (request deadlines tear a
    group down first); ``setup_timeout_s`` bounds placement, the auto probe and each group's start.
    """

    dp_size: int = 1
    sp_size: int = 1
    cpus_per_rank: float = CPUS_PER_RANK
    gpus_per_rank: float = 0.0
    strategy: str = "STRICT_PACK"
    pg_timeout_s: float = 3600.0
    setup_timeout_s: float = 900.0
    encoders_per_rank: int | None = None
    rank_standby: bool | None = None
    rank_standby_preload: bool = True
    executor: Literal["ray", "local"] = "ray"  # the transport: Ray actors, or processes of this host

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise FlagError(f"--data-parallel-size must be >= 1, got {self.dp_size}")
        if self.sp_size < 1:
            raise FlagError(f"--sequence-parallel-size must be >= 1, got {self.sp_size}")
        if self.strategy not in STRATEGIES:
            raise FlagError(f"--placement-strategy must be one of {list(STRATEGIES)}, got {self.strategy!r}")
        if self.executor not in ("ray", "local"):
            raise ValueError(f"executor must be ray or local, got {self.executor!r}")
        if self.encoders_per_rank is not None and self.encoders_per_rank < 0:
            raise FlagError(f"--encoders-per-rank must be >= 0, got {self.encoders_per_rank}")

    @property
    def processes(self) -> int:
        return self.dp_size * self.sp_size

    def bundles(self) -> list[dict[str, float]]:
        """One bundle per rank process (D x S); a Serve replica with 0 CPUs rides in bundle 0."""
        b: dict[str, float] = {"CPU": self.cpus_per_rank}
        if self.gpus_per_rank:
            b["GPU"] = self.gpus_per_rank
        return [dict(b) for _ in range(self.processes)]

    @property
    def use_standby(self) -> bool:
        """Standbys by default where recovery time matters and hosts are large (GPU ranks); on
        CPU (demos, tests on small hosts) each would cost a process's imports for little."""
        return self.gpus_per_rank > 0 if self.rank_standby is None else self.rank_standby

    @property
    def device(self) -> str:
        return "cuda" if self.gpus_per_rank else "cpu"
