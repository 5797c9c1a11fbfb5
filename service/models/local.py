"""N local ranks without Ray: ``torch.multiprocessing`` spawn + gloo (CPU) or NCCL (CUDA).

This is what ``dloserve generate --data-parallel-size N`` and the cross-strategy tests
use. Rank 0 runs the request; every other rank idle-replays its transformer forwards,
so all ranks make the same gathers in the same order (the DP-wave contract with one
request in the wave).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from service.offload.spawn import run_ranks

from .pipeline import OffloadConfig, PipelineRunner
from .request import GenerationRequest

GROUP_TIMEOUT = timedelta(minutes=10)


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r uses cuda:r on one host; CPU ranks share the host."""
    return torch.device("cuda", rank) if device == "cuda" else torch.device(device)


def launch(world: int, fn: Callable[..., None], args: tuple[Any, ...], device: str = "cpu") -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes inside one process group.

    Raises if any rank fails, with its traceback; the other ranks are stopped at once.
    """
    backend = "nccl" if device == "cuda" else "gloo"
    run_ranks(fn, world, *args, timeout=None, backend=backend, pg_timeout=GROUP_TIMEOUT)


def serve_one(
    runner: PipelineRunner,
    req: GenerationRequest,
    rank: int,
    on_step: Callable[[int, int], None] | None = None,
) -> bytes | None:
    """Rank 0 generates, the others idle-replay; returns the MP4 on rank 0 only."""
    if rank == 0:
        return runner.generate(req, on_step)
    runner.idle(req)
    return None


def generate_local(
    model_dir: str | Path,
    req: GenerationRequest,
    out: str | Path,
    world: int = 1,
    device: str = "cpu",
    offload: OffloadConfig | None = None,
    progress: bool = False,
) -> None:
    """Generate ``req`` with ``world`` local ranks and write the MP4 to ``out`` (rank 0)."""
    if world == 1:
        runner = PipelineRunner.load(model_dir, rank_device(device, 0), offload=offload, progress=progress)
        try:
            _write(out, runner.generate(req, _bar(req, progress)))
        finally:
            runner.close()
        return
    launch(world, _generate_rank, (str(model_dir), req, str(out), device, offload, progress), device)


def _generate_rank(
    rank: int,
    world: int,
    model_dir: str,
    req: GenerationRequest,
    out: str,
    device: str,
    offload: OffloadConfig | None,
    progress: bool,
) -> None:
    group = dist.group.WORLD if offload is not None and offload.enabled else None
    runner = PipelineRunner.load(
        model_dir, rank_device(device, rank), offload=offload, group=group, progress=progress and rank == 0
    )
    try:
        data = serve_one(runner, req, rank, _bar(req, progress) if rank == 0 else None)
        if data is not None:
            _write(out, data)
    finally:
        runner.close()


def _bar(req: GenerationRequest, enabled: bool) -> Callable[[int, int], None] | None:
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
