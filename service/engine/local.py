"""N local ranks without Ray: spawned processes in one process group, each a RankWorker.

``dloserve generate --data-parallel-size N`` runs here: rank 0 takes the request, every
rank ticks (the others replay its gathers), rank 0 writes the MP4. With
``--sequence-parallel-size S`` the S processes are one SP group: all of them take the
request and run it on 1/S of its tokens each; rank 0 writes the MP4. The same per-rank
loop the Ray workers run, driven from a plain process instead of an actor.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from service.models.pipeline import OffloadConfig, PipelineRunner
from service.models.request import GenerationRequest
from service.offload.spawn import run_ranks

from .rank import RankWorker

GROUP_TIMEOUT = timedelta(minutes=10)
StepFn = Callable[[int, int], None]


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r uses cuda:r on one host; CPU ranks share the host."""
    return torch.device("cuda", rank) if device == "cuda" else torch.device(device)


def control_group(world: int) -> dist.ProcessGroup | None:
    """A gloo group of all ranks for the per-tick agreement (None for one rank)."""
    return dist.new_group(backend="gloo") if world > 1 else None


def run_one(worker: RankWorker, job_id: str | None, req: GenerationRequest | None,
            on_step: StepFn | None = None) -> dict[str, Any] | None:
    """Tick until the group is idle; with a request, also wait for its finished event."""
    result: dict[str, Any] = {}
    done = threading.Event()

    def pump() -> None:
        while not done.is_set():
            for e in worker.events(0.5):
                if e["kind"] == "step" and on_step is not None:
                    on_step(e["step"], e["total"])
                elif e["kind"] == "finished" and e["id"] == job_id:
                    result.update(e)
                    done.set()

    if job_id is not None and req is not None:
        worker.assign(job_id, req)
        threading.Thread(target=pump, name="events", daemon=True).start()
    worker.serve()
    if job_id is None:
        return None
    done.wait()
    return result


def generate_local(
    model_dir: str | Path,
    req: GenerationRequest,
    out: str | Path,
    world: int = 1,
    device: str = "cpu",
    offload: OffloadConfig | None = None,
    progress: bool = False,
    sequence_parallel: int = 1,
) -> None:
    """Generate ``req`` with ``world`` local ranks and write the MP4 to ``out`` (rank 0).

    ``sequence_parallel`` > 1 must equal ``world``: one SP group runs the request.
    """
    if sequence_parallel > 1 and world != sequence_parallel:
        raise ValueError(f"one request runs on one SP group: world {world} != SP {sequence_parallel}")
    if world == 1:
        _generate_rank(0, 1, str(model_dir), req, str(out), device, offload, progress, 1)
        return
    backend = "nccl" if device == "cuda" else "gloo"
    run_ranks(_generate_rank, world, str(model_dir), req, str(out), device, offload, progress,
              sequence_parallel, timeout=None, backend=backend, pg_timeout=GROUP_TIMEOUT)


def _generate_rank(rank: int, world: int, model_dir: str, req: GenerationRequest, out: str,
                   device: str, offload: OffloadConfig | None, progress: bool, sp: int) -> None:
    offloaded = offload is not None and offload.enabled
    group = dist.group.WORLD if offloaded and world > 1 else None
    runner = PipelineRunner.load(model_dir, rank_device(device, rank), offload=offload, group=group,
                                 progress=progress and rank == 0, sequence_parallel=sp)
    worker = RankWorker(runner, rank, world, control_group(world), sequence_parallel=sp > 1,
                        lead=sp == 1 or rank == 0)
    try:
        mine = rank == 0 or sp > 1  # SP: every rank runs the request; DP: rank 0, others replay
        res = run_one(worker, "request" if mine else None, req if mine else None,
                      _bar(req, progress) if rank == 0 else None)
        if res is not None:
            if res["error"]:
                raise RuntimeError(res["error"])
            if rank == 0:
                _write(out, res["mp4"])
    finally:
        worker.close()
        runner.close()


def _bar(req: GenerationRequest, enabled: bool) -> StepFn | None:
    if not enabled:
        return None
    from tqdm import tqdm

    bar = tqdm(total=req.num_inference_steps, desc="denoising", unit="step")

    def on_step(done: int, total: int) -> None:
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return on_step


def _write(path: str | Path, data: bytes) -> None:
    """Write atomically: a reader never sees half a file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
