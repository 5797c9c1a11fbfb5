"""The one way a rank starts and stops, whatever runs it (a Ray actor, a local process, the
test process): join the group's process groups, load the pipeline, start the rank loop."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from service.models.pipeline import PipelineRunner

from .encoder import Encoder
from .rank import RankWorker
from .spec import EngineSpec


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


def start_rank(spec: EngineSpec, place: RankPlace, init_method: str | None, device: torch.device,
               on_report: Callable[[], None] | None = None, progress: bool = False) -> RankWorker:
    """Rank ``place`` of a group, loaded and looping; ``init_method`` is the TCP rendezvous of
    a group of several processes (None for one). Every process of the group calls it at once."""
    sp = spec.sp_size > 1
    t0 = time.monotonic()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if place.world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method,
                                rank=place.rank, world_size=place.world,
                                timeout=timedelta(seconds=spec.pg_timeout_s))
    control = control_group(place.world)  # the per-tick agreement, on the CPU
    t_group = time.monotonic()
    lead = not sp or place.lead
    encoder = Encoder(spec.encoders_per_rank if lead else 0)  # its processes start while we load
    gather = dist.group.WORLD if spec.settings.enabled and place.world > 1 else None
    try:
        runner = PipelineRunner.load(spec.model_dir, device, settings=spec.settings, group=gather,
                                     sequence_parallel=spec.sp_size, progress=progress)
    except BaseException:
        encoder.close()
        raise
    t_load = time.monotonic()
    encoder.wait_warm()
    worker = RankWorker(runner, place.rank, place.world, control, encoder, on_report=on_report,
                        sequence_parallel=sp, lead=lead)
    worker.start_stages = {"process_group_s": round(t_group - t0, 3), "load_s": round(t_load - t_group, 3),
                           **{f"load.{k}_s": v for k, v in runner.load_stages.items()},
                           "encoders_s": round(time.monotonic() - t_load, 3)}
    return worker


def stop_rank(worker: RankWorker | None) -> None:
    """Stop the loop, free the pipeline, leave the process group it joined (if any)."""
    if worker is None:
        return
    worker.close()
    worker.runner.close()
    if worker.world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def control_group(world: int) -> dist.ProcessGroup | None:
    """A gloo group of all ranks for the per-tick agreement (None for one rank)."""
    return dist.new_group(backend="gloo") if world > 1 else None


def load_facts(worker: RankWorker, t0: float) -> dict[str, Any]:
    """What a rank reports once it is ready (logged by the executor)."""
    runner = worker.runner
    return {"rank": worker.rank, "pid": os.getpid(), "setup_s": round(time.monotonic() - t0, 3),
            "stages": getattr(worker, "start_stages", {}), "mode": runner.settings.mode.value,
            "encoders": worker.encoder.workers,
            "choice": runner.choice, "compute": compute_facts(runner)}


def compute_facts(runner: Any) -> dict[str, Any]:
    """How the blocks compute (for the start log and /readyz): the SDPA kernel that runs,
    whether the block class is compiled, whether CFG rows share a forward."""
    compiled = runner.compiled.describe() if runner.compiled is not None else None
    return {"attention": runner.attention.get("backend"), "compile": compiled, "cfg_batch": runner.cfg_batch}


def probe_mode(spec: EngineSpec, device: torch.device) -> dict[str, Any]:
    """``--dlo-mode auto`` before the groups form: probe on one rank's device, choose for N.

    One rank cannot time an AllGather, so the choice counts the gather as free (it runs
    on a side stream; 1.4 ms of a 703 MB block on NVLink) and says so in its reason.
    """
    from service.models.pipeline import decide_auto
    from service.models.registry import load_adapter

    if device.type == "cuda":
        torch.cuda.set_device(device)
    choice, timings = decide_auto(load_adapter(spec.model_dir), device, spec.settings, None, spec.dp_size)
    if timings is not None and spec.dp_size > 1:
        choice["reason"] += "; AllGather time not measured before the group forms (taken as free)"
    return choice
