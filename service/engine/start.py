"""The one way a rank starts and stops, whatever runs it (a Ray actor, a local process, the
test process): join the group's process groups, load the pipeline, start the rank loop."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from service.config import EngineConfig, ModeChoice
from service.models.pipeline import PipelineRunner
from service.offload.mode import ProbeTimings

from .encoder import Encoder
from .place import RankPlace, rank_encoder
from .rank import RankWorker


def start_rank(config: EngineConfig, place: RankPlace, init_method: str | None, device: torch.device,
               on_report: Callable[[], None] | None = None, progress: bool = False,
               encoder: Encoder | None = None, preloaded: Preloaded | None = None) -> RankWorker:
    """Rank ``place`` of a group, loaded and looping; ``init_method`` is the TCP rendezvous of
    a group of several processes (None for one). Every process of the group calls it at once.
    ``encoder``: a pool started ahead (a standby's); else one starts here. ``preloaded``: the
    pipeline this process loaded ahead for this config (one process, no group: ``preload``)."""
    assert preloaded is None or place.world == 1, "a group of several processes loads after its rendezvous"
    sp = config.parallel.sp_size > 1
    t0 = time.monotonic()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if place.world > 1:
        assert init_method is not None, "a group of several processes needs a rendezvous"
        timeout = timedelta(seconds=config.parallel.pg_timeout_s)
        store = rendezvous_store(init_method, place.rank, place.world, timeout)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store,
                                rank=place.rank, world_size=place.world, timeout=timeout)
    control = control_group(place.world)  # the per-tick agreement, on the CPU
    t_group = time.monotonic()
    lead = not sp or place.lead
    if encoder is None:
        encoder = rank_encoder(config, place)  # its processes start while we load
    gather = dist.group.WORLD if config.offload.enabled and place.world > 1 else None
    try:
        runner = preloaded.runner if preloaded is not None else PipelineRunner.load(
            config.model_dir, device, config=config, group=gather, sequence_parallel=config.parallel.sp_size,
            progress=progress)
    except BaseException:
        encoder.close()
        raise
    t_load = time.monotonic()
    encoder.wait_warm()
    worker = RankWorker(runner, place.rank, place.world, control, encoder, on_report=on_report,
                        sequence_parallel=sp, lead=lead)
    ahead = {"preload_s": preloaded.seconds} if preloaded is not None else {}
    worker.start_stages = {"process_group_s": round(t_group - t0, 3), "load_s": round(t_load - t_group, 3),
                           **ahead, **{f"load.{k}_s": v for k, v in runner.load_stages.items()},
                           "encoders_s": round(time.monotonic() - t_load, 3)}
    return worker


@dataclass
class Preloaded:
    """A pipeline loaded before its rank's group formed (engine.standby's preload): the
    config it was loaded for, and how long that took (beside the rest of the start)."""

    config: EngineConfig
    runner: PipelineRunner
    seconds: float


def preload(config: EngineConfig, device: torch.device) -> Preloaded:
    """The load of a rank of a one-process group (no process group, no gather), ahead."""
    t0 = time.monotonic()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    runner = PipelineRunner.load(config.model_dir, device, config=config, group=None,
                                 sequence_parallel=config.parallel.sp_size)
    return Preloaded(config, runner, round(time.monotonic() - t0, 3))


def rendezvous_store(init_method: str, rank: int, world: int, timeout: timedelta) -> dist.TCPStore:
    """The group's TCPStore at ``tcp://HOST:PORT``; process 0 serves it on HOST only.

    A TCPStore given ``tcp://127.0.0.1:P`` alone listens on every interface, with no
    authentication: anyone reaching the node could read and overwrite the group's keys.
    Process 0 binds the socket itself, on the address it named, and hands it over.
    """
    hostport = init_method.removeprefix("tcp://")
    host, _, port = hostport.rpartition(":")
    host = host.strip("[]")
    if rank != 0:
        return dist.TCPStore(host, int(port), world, False, timeout=timeout)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port)))
        sock.listen(max(128, world))
    except OSError:
        sock.close()
        raise
    fd = sock.detach()  # the store's server owns the listening socket from here on
    return dist.TCPStore(host, int(port), world, True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=fd)


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
            "stages": getattr(worker, "start_stages", {}), "mode": runner.config.offload.mode.value,
            "encoders": worker.encoder.workers,
            "choice": runner.config.choice,  # typed: the engine takes a rank's auto choice (one group)
            "compute": compute_facts(runner)}


def compute_facts(runner: Any) -> dict[str, Any]:
    """How the blocks compute (for the start log and /readyz): the SDPA kernel that runs,
    whether the block class is compiled, whether CFG rows share a forward (and flash-attn-4's
    disk cache where it is imported)."""
    compiled = runner.compiled.describe() if runner.compiled is not None else None
    fa4 = {"fa4_cache": runner.attention["fa4_cache"]} if "fa4_cache" in runner.attention else {}
    return {"attention": runner.attention.get("backend"), **fa4, "compile": compiled,
            "cfg_batch": runner.cfg_batch}


def probe_mode(config: EngineConfig, device: torch.device) -> ModeChoice:
    """``--dlo-mode auto`` before the groups form: probe on one rank's device, choose for N
    (``dp_size``); no probe where a rule decides (``automode.rule_choice``)."""
    from service.models.automode import decide_auto
    from service.models.registry import load_adapter

    if device.type == "cuda":
        torch.cuda.set_device(device)
    choice = decide_auto(load_adapter(config.model_dir), device, config, None, config.parallel.dp_size)
    return _gather_untimed(choice, config)


def rule_mode(config: EngineConfig) -> ModeChoice | None:
    """auto's choice where no probe can change it (one rank on CUDA, CPU ranks, a family with
    no probe), decided in the caller's process: no rank process, no weights read."""
    from service.models.automode import rule_choice
    from service.models.registry import load_adapter

    adapter = load_adapter(config.model_dir, sequence_parallel=config.parallel.sp_size)
    return rule_choice(adapter, config.parallel.device, config, config.parallel.dp_size)


def cached_mode(config: EngineConfig, timings: ProbeTimings, measured_at: str) -> ModeChoice:
    """auto's choice for this config from timings an earlier start's probe measured."""
    from service.models.automode import choice_from
    from service.models.registry import load_adapter

    adapter = load_adapter(config.model_dir, sequence_parallel=config.parallel.sp_size)
    choice = choice_from(adapter, config, replace(timings, world=config.parallel.dp_size), source="cached")
    choice = replace(choice, reason=f"{choice.reason}; timings from the probe of {measured_at} "
                                    "(the probe cache: delete it to measure again)")
    return _gather_untimed(choice, config)


def _gather_untimed(choice: ModeChoice, config: EngineConfig) -> ModeChoice:
    """One rank cannot time an AllGather, so the choice counts the gather as free (it runs on
    a side stream; 1.4 ms of a 703 MB block on NVLink) and says so in its reason."""
    if choice.timings is not None and config.parallel.dp_size > 1:
        return replace(choice, reason=choice.reason + "; AllGather time not measured before the group forms "
                                                      "(taken as free)")
    return choice
