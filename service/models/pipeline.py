"""``PipelineRunner``: one loaded model on one rank, turning requests into MP4 bytes.

Memory policy: the transformer goes through the layerwise offload runtime (it is ~95% of
a Wan 14B pipeline's weights and the only part run many times per request), with K blocks
kept resident when ``resident_layers`` or a ``device_memory_gb`` budget asks for it. With
``components`` the text encoder streams too (its blocks through two slots that exist
while it runs) and the VAE is staged on the device for decode only (components.py).
``mode="auto"`` picks AllGather or rank-local from a short probe at load (offload.auto).

Every rank of a DP group loads the same runner; for each transformer forward of the group
a rank either runs one of its own request's forwards or ``idle_forwards(1)``-replays the
gathers, so all ranks make the same collective calls in the same order (service.engine.rank
decides which, forward by forward). With ``sequence_parallel`` S > 1 the S ranks of the
world are one SP group: all of them run every forward of the same request, each on 1/S of
its tokens (``sequence.py``), and the offload gathers each block over the same S ranks.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from service.offload import LayerwiseOffload, Placement, enable_layerwise_offload, load_resident
from service.offload.auto import ModeChoice, ProbeTimings, choose_mode, probe

from .adapter import ModelAdapter, load_adapter
from .request import GenerationRequest
from .video import encode_mp4

log = logging.getLogger("dloserve.models")
# Kept aside beside the probe's measured activation peak under --dlo-device-memory-gb: the
# peak moved by about 1 MB between runs on the H200 (a budget with no headroom was exceeded
# by 1.0 MB in loadtest/results/h200x2-placement-2026-11-30-resident.json).
BUDGET_HEADROOM = 256 * 2**20


@dataclass(frozen=True)
class OffloadConfig:
    """How the pipeline is served. ``dtype`` None keeps the checkpoint's dtypes.

    ``mode`` "auto" resolves ``use_allgather`` at load from a probe forward of
    ``probe_shape`` (height, width, frames); ``resident_layers`` or ``device_memory_gb``
    keep transformer blocks resident; ``components`` adds text_encoder / vae offload.
    """

    enabled: bool = True
    use_allgather: bool = True
    dtype: torch.dtype | None = None
    mode: str = "manual"  # "manual" (use_allgather as given) or "auto"
    resident_layers: int | None = None
    device_memory_gb: float | None = None
    components: tuple[str, ...] = ("dit",)
    probe_shape: tuple[int, int, int] | None = None
    quantization: str | None = None  # "fp8": the transformer blocks' Linear weights (offload.quant)

    @property
    def strategy(self) -> str:
        if not self.enabled:
            return "resident"
        if self.mode == "auto":
            return "auto"
        return "allgather" if self.use_allgather else "rank_local"

    @classmethod
    def from_options(cls, enabled: bool, use_allgather: bool, options: dict[str, Any] | None,
                     dtype: torch.dtype | None = None) -> OffloadConfig:
        """From the plain dict the CLIs and Serve config carry (models.options)."""
        o = dict(options or {})
        mode = o.pop("mode", None)
        if mode in ("allgather", "rank_local"):
            use_allgather = mode == "allgather"
        shape = o.pop("probe_shape", None)
        return cls(enabled=enabled, use_allgather=use_allgather, dtype=dtype,
                   mode="auto" if mode == "auto" else "manual",
                   probe_shape=tuple(shape) if shape else None,
                   components=tuple(o.pop("components", None) or ("dit",)), **o)


class PipelineRunner:
    """A model directory loaded for serving: the adapter's components plus the transformer."""

    def __init__(
        self,
        adapter: ModelAdapter,
        transformer: torch.nn.Module,
        handle: LayerwiseOffload | None,
        device: torch.device,
        offload: OffloadConfig,
        load_s: float,
        choice: ModeChoice | None = None,
    ) -> None:
        self.choice = choice
        self.adapter = adapter
        self.transformer = transformer
        self.handle = handle
        self.device = device
        self.offload = offload
        self.load_s = load_s
        self._closed = False

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        device: str | torch.device = "cpu",
        *,
        offload: OffloadConfig | None = None,
        group: dist.ProcessGroup | None = None,
        progress: bool = False,
        sequence_parallel: int = 1,
    ) -> PipelineRunner:
        """Load ``model_dir``; ``offload`` None or disabled means a fully resident transformer.

        With offload enabled every rank of ``group`` must call this (it shards the blocks).
        ``sequence_parallel`` S > 1: the torch.distributed world is one SP group of S ranks
        (pass it as ``group`` too, so the offload shards over the same ranks).
        """
        t0 = time.perf_counter()
        dev = torch.device(device)
        cfg = offload or OffloadConfig(enabled=False)
        adapter = load_adapter(model_dir, sequence_parallel=sequence_parallel)
        module = adapter.build_transformer()
        ckpt = adapter.transformer_checkpoint()
        handle, choice = None, None
        if cfg.enabled and sequence_parallel > 1 and group is not None:
            # The block gathers get a communicator of their own: NCCL runs one communicator's
            # work in issue order on one stream, so sharing the attention all-to-alls' (the
            # mesh reuses the world's) would queue them behind the next block's prefetch.
            group = dist.new_group(ranks=dist.get_process_group_ranks(group))
        if cfg.enabled:
            use_allgather, activation = cfg.use_allgather, 0
            probed = cfg.mode == "auto" or (cfg.device_memory_gb is not None and dev.type == "cuda")
            if probed:
                timings = probe_transformer(adapter, dev, cfg, group)
                activation = timings.activation_bytes + BUDGET_HEADROOM if timings.activation_bytes else 0
                if cfg.mode == "auto":
                    choice = choose_mode(timings)
                    use_allgather = choice.mode == "allgather"
                    log.info("offload mode auto: %s (%s)", choice.mode, choice.reason)
            budget = None if cfg.device_memory_gb is None else int(cfg.device_memory_gb * 2**30)
            try:
                handle = enable_layerwise_offload(
                    module,
                    ckpt,
                    device=dev,
                    group=group,
                    use_allgather=use_allgather,
                    block_attrs=list(adapter.block_attrs),
                    dtype=cfg.dtype,
                    keep_fp32=adapter.keep_fp32,
                    progress=_shard_bar() if progress else None,
                    placement=Placement(resident_blocks=cfg.resident_layers, device_memory_budget=budget,
                                        activation_bytes=activation),
                    quantization=cfg.quantization,
                )
            except ValueError as e:
                if "device_memory_budget" in str(e) or "resident_blocks" in str(e):
                    raise ValueError(f"--dlo-device-memory-gb / --dlo-resident-layers: {e}") from e
                raise
            if use_allgather != cfg.use_allgather:
                cfg = replace(cfg, use_allgather=use_allgather)
        else:
            load_resident(module, ckpt, dev, dtype=cfg.dtype, keep_fp32=adapter.keep_fp32,
                          quantization=cfg.quantization, block_attrs=list(adapter.block_attrs))
        if sequence_parallel > 1:
            from .sequence import enable_sequence_parallel

            try:
                enable_sequence_parallel(module, sequence_parallel)
            except BaseException:
                if handle is not None:
                    handle.close()
                raise
        adapter.load_components(dev, cfg.components if cfg.enabled else ("dit",))
        return cls(adapter, module, handle, dev, cfg, time.perf_counter() - t0, choice)

    # -- requests ----------------------------------------------------------------------

    def validate(self, req: GenerationRequest) -> None:
        """Raise RequestError naming the bad field, before any compute."""
        self.adapter.validate(req)

    def frames(
        self, req: GenerationRequest, on_step: Callable[[int, int], None] | None = None
    ) -> np.ndarray:
        """Run ``req``; uint8 frames [T, H, W, 3] (before MP4 encoding)."""
        self._check_open()
        self.validate(req)
        return self.adapter.run(self.transformer, req, on_step)

    def generate(
        self, req: GenerationRequest, on_step: Callable[[int, int], None] | None = None
    ) -> bytes:
        """Run ``req`` and return the MP4 bytes; ``on_step(done, total)`` after each step."""
        return encode_mp4(self.frames(req, on_step), req.fps)

    def idle_forwards(self, k: int) -> None:
        """Join the gathers of ``k`` transformer forwards without computing (one tick each)."""
        self._check_open()
        if self.handle is not None:
            self.handle.idle_forwards(k)

    def idle(self, req: GenerationRequest) -> None:
        """Join the gathers of ``req``'s transformer forwards without computing (idle rank)."""
        self._check_open()
        self.validate(req)
        if self.handle is not None:
            self.handle.idle_forwards(self.adapter.forwards(req))

    # -- introspection and teardown ----------------------------------------------------------

    def offload_stats(self, sync: bool = True) -> dict[str, Any] | None:
        return self.handle.stats(sync).as_dict() if self.handle is not None else None

    def describe(self) -> dict[str, Any]:
        """What is loaded and how (for health endpoints and logs)."""
        return {
            "family": self.adapter.family,
            "model_dir": str(self.adapter.model_dir),
            "device": str(self.device),
            "strategy": self.offload.strategy,
            "sequence_parallel": self.adapter.sequence_parallel,
            "mode_choice": self.choice.as_dict() if self.choice else None,
            "components": list(self.offload.components) if self.offload.enabled else [],
            "dtype": str(self.offload.dtype) if self.offload.dtype else None,
            "quantization": self.offload.quantization,
            "load_s": round(self.load_s, 3),
        }

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("PipelineRunner is closed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.handle is not None:
            self.handle.close()
        self.adapter.close()
        self.transformer = None  # type: ignore[assignment]
        # diffusers pipelines hold reference cycles: collect them so the weights go now,
        # not at some later gc pass while the next model is loading.
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def probe_transformer(adapter: ModelAdapter, dev: torch.device, cfg: OffloadConfig,
                      group: dist.ProcessGroup | None) -> ProbeTimings:
    """Timings of the transformer at ``cfg.probe_shape`` through a throw-away rank-local
    handle (mmap only, nothing sharded). Every rank of ``group`` calls it (it agrees)."""
    module = adapter.build_transformer()
    h = enable_layerwise_offload(module, adapter.transformer_checkpoint(), device=dev, use_allgather=False,
                                 block_attrs=list(adapter.block_attrs), dtype=cfg.dtype,
                                 keep_fp32=adapter.keep_fp32, quantization=cfg.quantization)
    try:
        height, width, frames = cfg.probe_shape or (480, 832, 81)
        inputs = adapter.probe_inputs(module, height, width, frames, dev)
        with torch.inference_mode():
            return probe(h, lambda: module(**inputs), group)
    finally:
        h.close()


def _shard_bar() -> Callable[[int, int], None]:
    """A tqdm bar over the blocks being sharded (the offload library takes a callback)."""
    from tqdm import tqdm

    bar = tqdm(desc="sharding blocks", unit="block", leave=False)

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return update
