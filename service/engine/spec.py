"""What an engine is built from (EngineSpec) and how one request ended (Outcome): plain data,
shared by the executors, the dispatcher and the front ends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.models.options import Mode, OffloadSettings

INGRESS_CPUS = 2  # left to the ingress (body parsing, image checks), the proxy and Ray's daemons
CPUS_PER_RANK = 1.0  # the default where the host is not ours to size (a cluster we join)


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
class EngineSpec:
    """How to build the rank groups of one ingress replica, batch job or ``generate``.

    ``settings`` travel to every rank unchanged (auto's choice replaces its mode once,
    before the groups form).
    """

    model_dir: str
    dp_size: int = 1
    sp_size: int = 1  # sequence parallel: each of the dp_size groups is S ranks
    settings: OffloadSettings = field(default_factory=lambda: OffloadSettings(Mode.ALLGATHER))
    cpus_per_rank: float = CPUS_PER_RANK
    gpus_per_rank: float = 0.0
    strategy: str = "STRICT_PACK"
    pg_timeout_s: float = 3600.0  # last resort: request deadlines tear a group down first
    setup_timeout_s: float = 900.0
    encoders_per_rank: int | None = None  # MP4 encoders per rank; None: from its CPUs (engine.encoder)
    # Ray: a pre-imported process per rank waits to replace it (engine.standby); None: on GPU ranks
    standby: bool | None = None

    def bundles(self) -> list[dict[str, float]]:
        """One bundle per rank process (D x S); a Serve replica with 0 CPUs rides in bundle 0."""
        b: dict[str, float] = {"CPU": self.cpus_per_rank}
        if self.gpus_per_rank:
            b["GPU"] = self.gpus_per_rank
        return [dict(b) for _ in range(self.dp_size * self.sp_size)]

    @property
    def use_standby(self) -> bool:
        """Standbys by default where recovery time matters and hosts are large (GPU ranks); on
        CPU (demos, tests on small hosts) each would cost a process's imports for little."""
        return self.gpus_per_rank > 0 if self.standby is None else self.standby

    @property
    def device(self) -> str:
        return "cuda" if self.gpus_per_rank else "cpu"

    @property
    def collective(self) -> bool:
        """Whether the ranks gather weights from each other (and so must tick together)."""
        return self.settings.mode is Mode.ALLGATHER and self.dp_size > 1

    def group_layout(self) -> list[tuple[int, int]]:
        """(first rank process, scheduler ranks) of each group: one AllGather group of N, N
        single ranks, or D SP groups (each one scheduler rank over S processes).
        Auto mode must be resolved first."""
        if self.settings.mode is Mode.AUTO:
            raise ValueError("resolve --dlo-mode auto before laying out the groups")
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
    cancelled: bool = False
    timings: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.mp4 is not None and self.error is None
