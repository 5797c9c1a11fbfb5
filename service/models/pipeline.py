"""``PipelineRunner``: one loaded model on one rank, turning requests into MP4 bytes.

Memory policy: the transformer goes through the layerwise offload runtime (it is ~95% of
a Wan 14B pipeline's weights and the only part run many times per request), with K blocks
kept resident when ``resident_layers`` or a ``device_memory_gb`` budget asks for it. With
``components`` the text encoder streams too (its blocks through two slots that exist
while it runs) and the VAE is staged on the device for decode only (components.py).
``mode="auto"`` picks AllGather or rank-local by a rule or a short probe at load (automode.py).

Every rank of a DP group loads the same runner; for each transformer forward of the group
a rank either runs one of its own request's forwards or ``idle_forwards(1)``-replays the
gathers, so all ranks make the same collective calls in the same order (service.engine.rank
decides which, forward by forward). With ``sequence_parallel`` S > 1 the S ranks of the
world are one SP group: all of them run every forward of the same request, each on 1/S of
its tokens (``sequence.py``), and the offload gathers each block over the same S ranks.

Two experts (Wan2.2 A14B): ``transformer`` is an ``Experts`` module and one offload handle
streams both through the same two slots; every forward uses one expert, and the handle is
told which expert the *next* forward uses (``expect``) so the switch is prefetched. Run by
the tick loop, the group agrees on that per tick (engine.experts); run directly (``frames``,
``idle``), the request's own plan says it (``adapter.expert_plan``), the same on every rank.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from service.config import EngineConfig, OffloadMode
from service.offload import LayerwiseOffload, Placement, enable_layerwise_offload, load_resident
from service.offload.checkpoint import Checkpoint
from service.offload.quant_checkpoint import prequantized_key

from . import attention
from .adapter import LatentsCallback, ModelAdapter
from .automode import cfg_batch_on, decide_auto, device_budget, dtype_of, probe_transformer
from .cache import StepCaches
from .checks import check_request
from .compiled import CompiledBlocks, backend_for, compile_on, warmup_shape
from .decode import FramesCallback
from .experts import expert_of
from .lora import RankAdapters
from .progress import progress_bar
from .registry import load_adapter
from .request import GenerationRequest, RequestError
from .video import encode_mp4

log = logging.getLogger("dloserve.models")
# Kept aside beside the probe's measured activation peak under --dlo-device-memory-gb: the
# peak moved by about 1 MB between runs on the H200 (a budget with no headroom was exceeded
# by 1.0 MB in loadtest/results/h200x2-placement-2026-11-30-resident.json).
BUDGET_HEADROOM = 256 * 2**20


class PipelineRunner:
    """A model directory loaded for serving: the adapter's components plus the transformer.

    ``config`` is the one it was loaded with, auto's choice resolved (``config.choice`` says
    what the probe measured and why).
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        transformer: torch.nn.Module,
        handle: LayerwiseOffload | None,
        device: torch.device,
        config: EngineConfig,
        load_s: float,
    ) -> None:
        self.adapter = adapter
        self.transformer = transformer
        self.handle = handle
        self.device = device
        self.config = config
        self.load_s = load_s
        self.load_stages: dict[str, float] = {}  # seconds per loading stage (cold-start report)
        self.loras = RankAdapters(transformer, adapter.family, str(adapter.index.get("_class_name", "")),
                                  device, config.lora.cache_bytes)
        self.caches = StepCaches(transformer, handle, adapter, config.step_cache)
        self.compiled: CompiledBlocks | None = None  # --compile (load sets it)
        self.attention: dict[str, Any] = {}  # the SDPA kernel that runs, and why (load sets it)
        self.cfg_batch = cfg_batch_on(config, device, adapter)
        adapter.cfg_rule = self._cfg_rule if self.cfg_batch else None
        self._closed = False
        self.experts = expert_of(transformer)  # the modules that each make one forward
        # Who says which expert comes next: the request's plan (False), or a tick loop that
        # agrees it with the group and calls expect() itself (engine.rank sets this).
        self.tick_driven = False
        self._plan: list[int] = []  # experts of the running request's forwards still to come
        self._plan_hooks = [m.register_forward_pre_hook(self._next_from_plan) for m in self.experts] \
            if len(self.experts) > 1 and handle is not None else []

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        device: str | torch.device = "cpu",
        *,
        config: EngineConfig | None = None,
        group: dist.ProcessGroup | None = None,
        progress: bool = False,
        sequence_parallel: int = 1,
    ) -> PipelineRunner:
        """Load ``model_dir``; ``config`` None (or offload mode resident): a fully resident transformer.
        ``config`` with ``--dlo-mode auto`` is resolved here (``decide_auto``) unless an executor
        resolved it already.

        With offload enabled every rank of ``group`` must call this (it shards the blocks).
        ``sequence_parallel`` S > 1: the torch.distributed world is one SP group of S ranks
        (pass it as ``group`` too, so the offload shards over the same ranks).
        """
        t0 = time.perf_counter()
        marks = {"start": t0}
        dev = torch.device(device)
        config = config or EngineConfig()
        dtype = dtype_of(config)
        adapter = load_adapter(model_dir, sequence_parallel=sequence_parallel)
        module = adapter.build_transformer()
        ckpt = adapter.transformer_checkpoint()
        config = with_checkpoint_quantization(config, ckpt)
        marks["build"] = time.perf_counter()
        attention.check(config.model.attention, expert_of(module)[0], dev, dtype)  # before any weights move
        marks["attention_check"] = time.perf_counter()
        handle = None
        off = config.offload
        if off.enabled and sequence_parallel > 1 and group is not None:
            # The block gathers get a communicator of their own: NCCL runs one communicator's
            # work in issue order on one stream, so sharing the attention all-to-alls' (the
            # mesh reuses the world's) would queue them behind the next block's prefetch.
            group = dist.new_group(ranks=dist.get_process_group_ranks(group))
        if off.enabled:
            activation, timings = 0, None
            if off.mode is OffloadMode.AUTO:
                choice = decide_auto(adapter, dev, config, group)
                config, timings = config.resolved(choice), choice.timings
                off = config.offload
                log.info("offload mode auto: %s (%s)", choice.mode.value, choice.reason)
            # A budget in GiB holds the activations too (measured by the probe forward, on CUDA
            # only: elsewhere it measures none and was a whole forward at the probe size); the
            # default share holds the weights only: activations use the rest of the GPU.
            budget, shared = device_budget(off, dev, sequence_parallel)
            if timings is None and budget is not None and not shared and dev.type == "cuda":
                timings = probe_transformer(adapter, dev, config, group)
            if timings is not None and timings.activation_bytes and not shared:
                activation = timings.activation_bytes + BUDGET_HEADROOM
            if budget is not None and not shared:  # the adapter LRU is on the device too
                activation += config.lora.cache_bytes
            marks["probe"] = time.perf_counter()

            def stream(budget: int | None) -> LayerwiseOffload:
                return enable_layerwise_offload(
                    module,
                    ckpt,
                    device=dev,
                    group=group,
                    mode=off.mode,
                    block_attrs=list(adapter.offload_block_attrs),
                    dtype=dtype,
                    keep_fp32=adapter.keep_fp32,
                    progress=progress_bar("sharding blocks", "block") if progress else None,
                    placement=Placement(resident_blocks=off.resident_layers, device_memory_budget=budget,
                                        activation_bytes=activation, fill_behind=True),
                    quantization=config.model.quantization,
                    experts=adapter.experts if len(adapter.experts) > 1 else None,
                )

            try:
                handle = stream(budget)
            except ValueError as e:
                if shared and "below what streaming every block needs" in str(e):
                    log.info("--dlo-device-share %g: %s; every block streams", off.device_share, e)
                    handle = stream(None)
                elif "device_memory_budget" in str(e) or "resident_blocks" in str(e):
                    raise ValueError(f"--dlo-device-memory-gb / --dlo-resident-layers: {e}") from e
                else:
                    raise
            if shared:
                placed = handle.stats(sync=False)
                log.info("--dlo-device-share %g of the GPU's %.1f GiB: %d of %d blocks resident, the rest "
                         "stream", off.device_share, budget / off.device_share / 2**30,
                         placed.resident_blocks, placed.blocks)
        else:
            load_resident(module, ckpt, dev, dtype=dtype, keep_fp32=adapter.keep_fp32,
                          quantization=config.model.quantization,
                          block_attrs=list(adapter.offload_block_attrs))
        if sequence_parallel > 1:
            from .sequence import enable_sequence_parallel

            try:
                enable_sequence_parallel(module, sequence_parallel)
            except BaseException:
                if handle is not None:
                    handle.close()
                raise
        marks["transformer"] = time.perf_counter()
        try:  # a failed warm-up or component load stops the copies behind it (fill_behind)
            attn = attention.report(expert_of(module)[0], dev, dtype, config.model.attention)
            if attn.get("approximate"):
                log.warning("attention: self-attention runs %s, approximate (%s); cross-attention %s",
                            attn["backend"], attn["error"], attn["cross_attention"])
            else:
                log.info("attention: self %s, cross %s (SDPA order %s; %s)", attn["backend"],
                         attn["cross_attention"], " > ".join(attn["order"]), attn["why"])
            compiled = None
            if compile_on(config.model, dev, adapter):
                compiled = CompiledBlocks(module, adapter.offload_block_attrs, backend_for(dev),
                                          quantization=config.model.quantization)
                if adapter.can_probe:  # the compile at start-up, at the probe size (or the smallest on CPU)
                    height, width, frames = off.probe_shape or warmup_shape(adapter, dev)
                    first = expert_of(module)[0]
                    batch = 2 if cfg_batch_on(config, dev, adapter) else 1
                    inputs = adapter.probe_inputs(first, height, width, frames, dev, batch)
                    with attention.chosen(config.model.attention):  # the kernels the forwards will trace
                        compiled.warm_up(lambda: first(**inputs))
                marks["compile"] = time.perf_counter()
            adapter.load_components(dev, off.components)
            marks["components"] = time.perf_counter()
            if handle is not None:  # the resident blocks filled behind the warm-up and the components
                handle.wait_resident()
                marks["resident"] = time.perf_counter()
        except BaseException:
            if handle is not None:
                handle.close()
            raise
        runner = cls(adapter, module, handle, dev, config, time.perf_counter() - t0)
        runner.compiled = compiled
        runner.attention = attn
        runner.load_stages = _durations(marks)
        return runner

    # -- requests ----------------------------------------------------------------------

    def _cfg_rule(self, req: GenerationRequest) -> bool:
        """Which CFG requests this server batches: those without a step cache (a cache decides
        per branch, on the branch's own residuals)."""
        return not self.caches.resolve(req.cache).enabled

    def validate(self, req: GenerationRequest) -> None:
        """Raise RequestError naming the bad field, before any compute."""
        check_request(self.adapter, req, self.loras.cache.budget, self.caches.default)
        why = self.resume_blocker(req) if req.resume is not None else ""
        if why:
            raise RequestError("resume", f"this request cannot go on from a saved step: {why}")

    def resume_blocker(self, req: GenerationRequest) -> str:
        """Why a rerun of ``req`` cannot start from its last step's state ("" when it can):
        the family's rule (models/resume.py, models/loop.py)."""
        return self.adapter.resume_blocker(req)

    def resumable(self, req: GenerationRequest) -> bool:
        return not self.resume_blocker(req)

    def frames(
        self, req: GenerationRequest, on_step: Callable[[int, int], None] | None = None,
        on_latents: LatentsCallback | None = None, on_frames: FramesCallback | None = None,
        denoiser: Any = None,
    ) -> np.ndarray | None:
        """Run ``req``; uint8 frames [T, H, W, 3] (before MP4 encoding). ``on_latents``: each
        step's latents but the last's, when ``req`` is ``resumable``. ``on_frames``: the frames
        go there instead, in order, chunk by chunk as the VAE decodes them (whole where the
        family cannot: ``adapter.streams_frames``), and this returns None. ``denoiser``: a batch
        member's stand-in (models/batch.py): its driver holds ``applied`` and runs the forwards."""
        self._check_open()
        self.validate(req)
        keep = on_latents if self.resumable(req) else None
        if denoiser is None and self._plan_hooks and not self.tick_driven:
            self._plan = list(self.adapter.expert_plan(req))
        with self.applied(req) if denoiser is None else nullcontext():
            model = self.transformer if denoiser is None else denoiser
            if on_frames is not None and self.adapter.streams_frames:
                return self.adapter.run(model, req, on_step, keep, on_frames)  # type: ignore[call-arg]
            frames = self.adapter.run(model, req, on_step, keep)
        if on_frames is None:
            return frames
        on_frames(frames)
        return None

    @contextmanager
    def applied(self, req: GenerationRequest) -> Iterator[None]:
        """What ``req``'s forwards run under: compile mode, attention kernel, LoRA set, step
        cache (a batch enters it once for all its members: their batch key is the same)."""
        cache = self.caches.resolve(req.cache)
        eager = self.compiled.eager(bool(req.loras)) if self.compiled else nullcontext()
        with eager, attention.chosen(self.config.model.attention), self.loras.applied(req.loras), \
                self.caches.applied(cache, req.num_inference_steps):
            yield

    def generate(
        self, req: GenerationRequest, on_step: Callable[[int, int], None] | None = None
    ) -> bytes:
        """Run ``req`` and return the MP4 bytes; ``on_step(done, total)`` after each step."""
        return encode_mp4(self.frames(req, on_step), req.fps)

    def idle_forwards(self, k: int, expert: int = 0) -> None:
        """Join the gathers of ``k`` forwards of ``expert`` without computing (one tick each)."""
        self._check_open()
        if self.handle is not None:
            self.handle.idle_forwards(k, expert)

    def expect(self, expert: int) -> None:
        """The expert the next forward uses (the ring prefetches its first block)."""
        if self.handle is not None and len(self.experts) > 1:
            self.handle.expect(expert)

    def idle(self, req: GenerationRequest) -> None:
        """Join the gathers of ``req``'s transformer forwards without computing (idle rank)."""
        self._check_open()
        self.validate(req)
        if self.handle is None:
            return
        if len(self.experts) == 1:
            self.handle.idle_forwards(self.adapter.forwards(req))
            return
        plan = self.adapter.expert_plan(req)  # what the running rank's plan says, forward by forward
        for k, expert in enumerate(plan):
            self.handle.expect(plan[k + 1] if k + 1 < len(plan) else 0)
            self.handle.idle_forwards(1, expert)

    def _next_from_plan(self, module: torch.nn.Module, args: object) -> None:
        """Before each forward of a request run by ``frames``: expect the next one's expert
        (a new request starts with the high-noise expert, 0)."""
        if self.tick_driven or self.handle is None:
            return
        if self._plan:
            self._plan.pop(0)
        self.handle.expect(self._plan[0] if self._plan else 0)

    # -- introspection and teardown ----------------------------------------------------------

    def offload_stats(self, sync: bool = True) -> dict[str, Any] | None:
        return self.handle.stats(sync).as_dict() if self.handle is not None else None

    def describe(self) -> dict[str, Any]:
        """What is loaded and how (for health endpoints and logs)."""
        return {
            "family": self.adapter.family,
            "card": self.adapter.card(),
            "model_dir": str(self.adapter.model_dir),
            "device": str(self.device),
            "strategy": self.config.offload.mode.value,
            "sequence_parallel": self.adapter.sequence_parallel,
            "mode_choice": self.config.choice.as_dict() if self.config.choice else None,
            "components": list(self.config.offload.components) if self.config.offload.enabled else [],
            "dtype": self.config.model.dtype,
            "quantization": self.config.model.quantization,
            "cfg_batch": self.cfg_batch,
            "attention": self.attention,
            "compile": self.compiled.describe() if self.compiled else None,
            "load_s": round(self.load_s, 3),
            "lora_cache": self.loras.stats(),
        }

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("PipelineRunner is closed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for h in self._plan_hooks:
            h.remove()
        if self.compiled is not None:
            self.compiled.close()
        if self.handle is not None:
            self.handle.close()
        self.adapter.close()
        self.transformer = None  # type: ignore[assignment]
        # diffusers pipelines hold reference cycles: collect them so the weights go now,
        # not at some later gc pass while the next model is loading.
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _durations(marks: dict[str, float]) -> dict[str, float]:
    """Consecutive marks -> seconds of each stage (named by the mark that ends it)."""
    names = list(marks)
    return {b: round(marks[b] - marks[a], 3) for a, b in zip(names, names[1:], strict=False)}


def with_checkpoint_quantization(config: EngineConfig, ckpt: Any) -> EngineConfig:
    """``quantization`` None (the flag's auto) made the checkpoint's own: "fp8" for a folder
    ``dloserve quantize`` wrote (the folder says what it holds), else left as it is.
    ``"none"`` with such a folder is refused at load, naming the flag."""
    if config.model.quantization is not None:
        return config
    for path in ckpt.values() if isinstance(ckpt, dict) else (ckpt,):
        opened = Checkpoint(path)
        try:
            if prequantized_key(opened) is not None:
                return replace(config, model=replace(config.model, quantization="fp8"))
        finally:
            opened.close()
    return config
