"""``PipelineRunner``: one loaded model on one rank, turning requests into MP4 bytes.

Memory policy: only the transformer goes through the layerwise offload runtime (it is
~95% of a Wan 14B pipeline's weights and the only part run many times per request).
The text encoder and the VAE stay resident on the device: for Wan2.1-14B that is the
UMT5-XXL encoder (~11 GB bf16) plus the VAE (~0.5 GB fp32). Both run once per request,
so they could be offloaded whole (moved to the device for their one call) at the cost of
one host-to-device copy each per request; that is not done yet.

Every rank of a DP group loads the same runner; for each transformer forward of the group
a rank either runs one of its own request's forwards or ``idle_forwards(1)``-replays the
gathers, so all ranks make the same collective calls in the same order (service.engine.rank
decides which, forward by forward). With ``sequence_parallel`` S > 1 the S ranks of the
world are one SP group: all of them run every forward of the same request, each on 1/S of
its tokens (``sequence.py``), and the offload gathers each block over the same S ranks.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from service.offload import LayerwiseOffload, enable_layerwise_offload, load_resident

from .adapter import ModelAdapter, load_adapter
from .request import GenerationRequest
from .video import encode_mp4


@dataclass(frozen=True)
class OffloadConfig:
    """How the transformer is served. ``dtype`` None keeps the checkpoint's dtypes."""

    enabled: bool = True
    use_allgather: bool = True
    dtype: torch.dtype | None = None

    @property
    def strategy(self) -> str:
        if not self.enabled:
            return "resident"
        return "allgather" if self.use_allgather else "rank_local"


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
    ) -> None:
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
        handle = None
        if cfg.enabled and sequence_parallel > 1 and group is not None:
            # The block gathers get a communicator of their own: NCCL runs one communicator's
            # work in issue order on one stream, so sharing the attention all-to-alls' (the
            # mesh reuses the world's) would queue them behind the next block's prefetch.
            group = dist.new_group(ranks=dist.get_process_group_ranks(group))
        if cfg.enabled:
            handle = enable_layerwise_offload(
                module,
                ckpt,
                device=dev,
                group=group,
                use_allgather=cfg.use_allgather,
                block_attrs=list(adapter.block_attrs),
                dtype=cfg.dtype,
                keep_fp32=adapter.keep_fp32,
                progress=_shard_bar() if progress else None,
            )
        else:
            load_resident(module, ckpt, dev, dtype=cfg.dtype, keep_fp32=adapter.keep_fp32)
        if sequence_parallel > 1:
            from .sequence import enable_sequence_parallel

            try:
                enable_sequence_parallel(module, sequence_parallel)
            except BaseException:
                if handle is not None:
                    handle.close()
                raise
        adapter.load_components(dev)
        return cls(adapter, module, handle, dev, cfg, time.perf_counter() - t0)

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
            "dtype": str(self.offload.dtype) if self.offload.dtype else None,
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
