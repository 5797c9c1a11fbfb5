"""``--dlo-mode auto``, resolved: a rule where the answer is known without measuring, else a
probe forward (``service.offload.auto``) whose timings ``choose_mode`` turns into the choice.

Where no probe is needed (``rule_choice``):

- a family with no probe inputs: AllGather, the default;
- CPU ranks without ``--dlo-probe-size``: rank-local (no PCIe link to share: a rank-local fill
  is a read of the page cache, and compute on the CPU covers it);
- one rank on CUDA: with N=1 AllGather gathers nothing: its fill is the whole block from a
  pinned host copy over the rank's own link, the fastest source there is. Rank-local matches
  it where the copy engine can read the checkpoint's page cache as stored (13.3 vs 12.9 ms per
  703 MB block, 152.1 vs 153.6 ms per forward on an H200) and then copies and pins nothing at
  load (0.4-1.0 s for 12-40 layers, against a pinned copy of the whole transformer): so
  rank-local where the blocks can be DMA'd from the files (``pagecache_problem``, checked on
  the host, no device), else AllGather (rank-local's pack thread: 487 vs 6.4 ms per 352 MB FP8
  block, loadtest/results/h200-startup-2026-12-02-again.json). It is ``choose_mode``'s rule
  at N=1 with the source known before anything is measured; the probe chose the same in
  both of those H200 starts. Should the registration itself fail at load, rank-local falls
  back to its pack thread and says so (``offload.rank_local_source``).

Every choice says where it came from (``source``: ``rule``, ``probe`` or ``cached``, the
executor's probe cache: service.engine.probe_cache).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from service.config import EngineConfig, ModeChoice, OffloadConfig, OffloadMode
from service.config.offload import PROBE_SHAPE
from service.offload import enable_layerwise_offload
from service.offload.auto import ProbeTimings, choose_mode, probe

from .adapter import ModelAdapter
from .experts import lockstep_expert_cost
from .request import GenerationRequest


def cfg_batch_on(config: EngineConfig, device: torch.device, adapter: ModelAdapter) -> bool:
    """Whether this server batches CFG rows (``--cfg-batch``): the settings and the device,
    for a family whose pipeline makes cond/uncond pairs; refused with sequence parallelism."""
    if adapter.sequence_parallel > 1:
        if config.model.cfg_batch == "on":
            raise ValueError("--cfg-batch on: not yet with --sequence-parallel-size > 1")
        return False
    return adapter.cfg_batchable and config.model.cfg_batching(device.type)


def dtype_of(config: EngineConfig) -> torch.dtype | None:
    """The torch dtype the config names (None: keep the checkpoint's)."""
    return getattr(torch, config.model.dtype) if config.model.dtype else None


def rule_choice(adapter: ModelAdapter, device_type: str, config: EngineConfig,
                world: int) -> ModeChoice | None:
    """The choice where measuring cannot change it (the module's doc says why), else None."""
    if not adapter.can_probe:
        return ModeChoice(OffloadMode.ALLGATHER,
                          f"{adapter.family} has no load-time probe: AllGather, the default", source="rule")
    if device_type == "cpu" and config.offload.probe_shape is None:
        return ModeChoice(OffloadMode.RANK_LOCAL,
                          "CPU ranks: a rank-local fill reads the shared page cache and compute covers it "
                          "(no probe; give --dlo-probe-size to measure)", source="rule")
    if device_type == "cuda" and world == 1:
        one = "one rank, no probe: AllGather gathers nothing, it fills each block from a pinned host copy"
        problem = pagecache_problem(adapter, config)
        if problem is None:
            return ModeChoice(OffloadMode.RANK_LOCAL,
                              f"{one}; rank-local's copy engine reads the checkpoint's page cache as fast "
                              "and copies and pins nothing at load", source="rule")
        return ModeChoice(OffloadMode.ALLGATHER,
                          f"{one}; rank-local could not DMA the page cache ({problem}): its pack thread "
                          "is slower", source="rule")
    return None


def device_budget(off: OffloadConfig, dev: torch.device,
                  sequence_parallel: int = 1) -> tuple[int | None, bool]:
    """The device bytes the streamed transformer may take (``Placement.device_memory_budget``),
    and whether it is the default share of the GPU (``--dlo-device-share``: the weights only,
    resident blocks, slots and non-block tensors; the activations, the components and a
    standby use the rest) rather than ``--dlo-device-memory-gb`` (the probe's activations
    within it). None: ``--dlo-resident-layers`` places the blocks, or every block streams
    (CPU, SP, a share of 0)."""
    if off.device_memory_gb is not None:
        return int(off.device_memory_gb * 2**30), False
    if off.resident_layers is not None or not off.device_share or dev.type != "cuda" or sequence_parallel > 1:
        return None, False
    return int(off.device_share * torch.cuda.get_device_properties(dev).total_memory), True


def pagecache_problem(adapter: ModelAdapter, config: EngineConfig) -> str | None:
    """Why a rank-local fill could not DMA the blocks from the checkpoint's files as stored
    (a cast, FP8 quantized at load, an odd offset), or None: the blocks of a throw-away
    rank-local handle on the host (mmap only: nothing is copied, no device)."""
    only = adapter.experts[0]  # experts have one block layout
    module = adapter.build_transformer(only)
    try:
        h = enable_layerwise_offload(module, adapter.transformer_checkpoint(only), device=torch.device("cpu"),
                                     mode=OffloadMode.RANK_LOCAL, block_attrs=list(adapter.block_attrs),
                                     dtype=dtype_of(config), keep_fp32=adapter.keep_fp32,
                                     quantization=config.model.quantization or adapter.stored_quantization())
    except Exception as e:  # noqa: BLE001 - the load says it properly; here: not DMA-able
        return f"not checked: {e}"
    try:
        return h.host.dma_problem()
    finally:
        h.close()


def choice_from(adapter: ModelAdapter, config: EngineConfig, timings: ProbeTimings,
                source: str = "probe") -> ModeChoice:
    """``choose_mode`` on ``timings`` (measured now, or cached), with two experts' cost."""
    choice = choose_mode(timings, expert_mix=expert_mix(adapter, config, timings.world))
    return replace(choice, source=source)


def decide_auto(adapter: ModelAdapter, dev: torch.device, config: EngineConfig,
                group: dist.ProcessGroup | None, world: int | None = None) -> ModeChoice:
    """``--dlo-mode auto``, resolved: the one place the choice is made (the executors run it
    once through ``service.engine.start.probe_mode``; ``PipelineRunner.load`` runs it for a
    config no executor resolved). ``world`` overrides the group's size (a probe on one rank
    for N). ``rule_choice`` first: no probe where measuring cannot change the answer."""
    n = world if world is not None else (dist.get_world_size(group) if group is not None else 1)
    rule = rule_choice(adapter, dev.type, config, n)
    if rule is not None:
        return rule
    timings = probe_transformer(adapter, dev, config, group)
    if world is not None:
        timings = replace(timings, world=world)
    return choice_from(adapter, config, timings)


# The step counts auto mode's expert estimate mixes (requests of one size, steps as users vary
# them): with equal plans a group stays in step and two experts cost nothing.
MIX_STEPS = (20, 50, 30, 40) * 10


def expert_mix(adapter: ModelAdapter, config: EngineConfig, world: int) -> float:
    """What two experts cost an AllGather group of ``world`` ranks, for auto mode: the extra
    ticks of the group's rule (``lockstep_expert_cost``) over requests at the probe size with
    ``MIX_STEPS`` step counts (0 with one expert or one rank)."""
    if len(adapter.experts) == 1 or world <= 1:
        return 0.0
    height, width, frames = config.offload.probe_shape or PROBE_SHAPE
    plans = [adapter.expert_plan(GenerationRequest(prompt="probe", height=height, width=width,
                                                   num_frames=frames, num_inference_steps=steps))
             for steps in MIX_STEPS]
    return lockstep_expert_cost(plans, world)


def probe_transformer(adapter: ModelAdapter, dev: torch.device, config: EngineConfig,
                      group: dist.ProcessGroup | None) -> ProbeTimings:
    """Timings of the transformer at the config's probe shape through a throw-away rank-local
    handle (mmap only, nothing sharded). Every rank of ``group`` calls it (it agrees)."""
    only = adapter.experts[0]  # experts have one block shape: probing the first is enough
    module = adapter.build_transformer(only)
    h = enable_layerwise_offload(module, adapter.transformer_checkpoint(only), device=dev,
                                 mode=OffloadMode.RANK_LOCAL, block_attrs=list(adapter.block_attrs),
                                 dtype=dtype_of(config), keep_fp32=adapter.keep_fp32,
                                 quantization=config.model.quantization)
    try:
        height, width, frames = config.offload.probe_shape or PROBE_SHAPE
        batch = 2 if cfg_batch_on(config, dev, adapter) else 1  # CFG rows in one forward
        inputs = adapter.probe_inputs(module, height, width, frames, dev, batch)
        with torch.inference_mode():
            return probe(h, lambda: module(**inputs), group)
    finally:
        h.close()
