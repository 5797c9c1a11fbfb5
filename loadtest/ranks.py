"""Run a function on N local processes joined in one process group (no Ray): for the tests
and the benchmarks (gloo on CPU, or NCCL with rank r on GPU r). Not part of the service.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from service.engine.ports import free_port

# Ranks fork from one server that has imported these once (a spawned rank spent 5-15 s of
# CPU importing torch and diffusers again, per rank, per call: most of a small test's time).
PRELOAD = ["torch", "torch.distributed", "diffusers", "service.offload", "service.models.pipeline"]


def _context() -> Any:
    """The fork-server context, its preload set before the server first starts."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(rank: int, world: int, port: int, out: str, backend: str, pg_timeout: timedelta,
           fn: Callable[..., Any], args: tuple, env: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's at its start
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # ranks share the host's cores
    try:
        kwargs: dict[str, Any] = {"rank": rank, "world_size": world, "timeout": pg_timeout}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kwargs["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, **kwargs)
        result = fn(rank, world, *args)
        torch.save(result, f"{out}/{rank}.pt")
    except BaseException:
        Path(f"{out}/{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float | None = 240,
              backend: str = "gloo", pg_timeout: timedelta = timedelta(minutes=10)) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned processes; returns their results.

    ``backend="nccl"`` puts rank r on GPU r. When a rank fails the others are killed at
    once (they would otherwise wait in a collective until ``pg_timeout``); ``timeout``
    bounds the whole run (None: no bound). Raises with every failed rank's traceback.
    """
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise RuntimeError(f"{world} ranks need {world} GPUs, found {torch.cuda.device_count()}")
    port = free_port()
    ctx = _context()
    env = dict(os.environ)
    deadline = None if timeout is None else time.monotonic() + timeout
    with tempfile.TemporaryDirectory() as out:
        procs = [ctx.Process(target=_entry, args=(r, world, port, out, backend, pg_timeout, fn, args, env))
                 for r in range(world)]
        for p in procs:
            p.start()
        timed_out = False
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # one rank failed: the rest would hang in a collective
            if deadline is not None and time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        msgs = [e.read_text() for e in (Path(f"{out}/{r}.err") for r in range(world)) if e.exists()]
        if timed_out or msgs or any(p.exitcode != 0 for p in procs):
            codes = [p.exitcode for p in procs]
            why = f"timed out after {timeout} s" if timed_out else "failed"
            raise RuntimeError(f"ranks {why} (exit codes {codes}):\n" + "\n".join(msgs))
        return [torch.load(f"{out}/{r}.pt", weights_only=False) for r in range(world)]
