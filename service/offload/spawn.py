"""Run a function on N local processes joined in one process group (no Ray).

For tests, benchmarks and the single-host CLI: gloo on CPU, or NCCL with rank r on GPU r.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world: int, port: int, out: str, backend: str, fn: Callable[..., Any], args: tuple
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # ranks share the host's cores
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        torch.save(result, f"{out}/{rank}.pt")
    except BaseException:
        Path(f"{out}/{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 240, backend: str = "gloo"
) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned processes; returns their results.

    ``backend="nccl"`` puts rank r on GPU r.
    """
    port = free_port()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out:
        procs = [
            ctx.Process(target=_entry, args=(r, world, port, out, backend, fn, args)) for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        errors = [Path(f"{out}/{r}.err") for r in range(world)]
        msgs = [e.read_text() for e in errors if e.exists()]
        if msgs or any(p.exitcode != 0 for p in procs):
            codes = [p.exitcode for p in procs]
            raise RuntimeError(f"ranks failed (exit codes {codes}):\n" + "\n".join(msgs))
        return [torch.load(f"{out}/{r}.pt", weights_only=False) for r in range(world)]
