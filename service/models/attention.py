"""Which attention kernel runs, chosen on purpose and reported.

diffusers' Wan and Flux attention call ``F.scaled_dot_product_attention``; which fused kernel
torch dispatches it to depends on its priority order, the device, dtype and head size. The
order is set here, exact kernels only, fastest first as measured on an H200 at the Wan2.1-14B
shape (40 heads x 128, bf16; loadtest/results/h200-compute-2026-12-02.json, self + cross
attention of one block at 32,760 tokens): cuDNN 39.4 ms, flash 61.8 ms, memory-efficient
122.8 ms. What torch then picks for the model's own head shape and dtype is reported at load
(the log, ``describe()``, and ``/readyz``'s last start).

Approximate kernels are opt-in (``--attention fp8`` / ``int8-fp8``, service.models.fp8_attention):
our own 8-bit flash-attention forward for Wan's self-attention on Hopper GPUs, 1.13x (fp8) /
1.09x (int8-fp8) cuDNN at 32,760 tokens with a mean relative error of 0.05-0.10 / 0.04
(docs/benchmarks.md). ``chosen`` routes Wan's self-attention to it; cross-attention (other
lengths) and masked attention stay exact; sequence parallelism refuses it (engine config).
SageAttention 1 was slower than cuDNN.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from service.config.errors import FlagError

from . import fp8_attention

ORDER = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
         SDPBackend.MATH)
WHY = ("exact kernels, fastest first as measured on an H200 at 40 heads x 128 bf16: cuDNN 39.4 ms, "
       "flash 61.8 ms, memory-efficient 122.8 ms (self + cross attention of one block, 32,760 tokens)")


APPROXIMATE = {"fp8": False, "int8-fp8": True}  # --attention -> the kernel's qk_int8
ERROR = {"fp8": "mean relative error 0.053 (random q, k, v) to 0.10 (sharper attention, q x 4) against "
                "the exact fp32 output; cuDNN bf16: 0.002",
         "int8-fp8": "mean relative error 0.036-0.039 (random q, k, v; sharper attention, q x 2 and x 4) "
                     "against the exact fp32 output; cuDNN bf16: 0.002"}


@contextmanager
def chosen(backend: str = "exact") -> Iterator[None]:
    """SDPA with the priority order above (torch falls through to the next kernel where one
    does not support the inputs, e.g. cuDNN on the CPU); with an approximate ``backend``, Wan's
    self-attention goes to our kernel for the duration (the same router object each time, so a
    compiled block traced under it is not recompiled)."""
    with sdpa_kernel(list(ORDER), set_priority=True):
        if backend == "exact":
            yield
            return
        from diffusers.models.transformers import transformer_wan as wan

        original = wan.dispatch_attention_fn
        wan.dispatch_attention_fn = _router(original, APPROXIMATE[backend])
        try:
            yield
        finally:
            wan.dispatch_attention_fn = original


@cache
def _router(original: Any, qk_int8: bool) -> Any:
    """diffusers' ``dispatch_attention_fn`` with unmasked same-length CUDA attention sent to the
    8-bit kernel; everything else (cross-attention, masks, SP's parallel_config) to ``original``."""

    def dispatch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                 scale: float | None = None, **kwargs: Any) -> torch.Tensor:
        if (attn_mask is None and dropout_p == 0.0 and not is_causal and scale is None
                and kwargs.get("parallel_config") is None and query.is_cuda
                and query.shape == key.shape == value.shape
                and query.dtype in (torch.bfloat16, torch.float16)):
            return fp8_attention.attend(query, key, value, qk_int8)
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, **kwargs)

    return dispatch


def check(backend: str, transformer: torch.nn.Module, device: torch.device) -> None:
    """FlagError naming ``--attention`` where an approximate ``backend`` cannot serve this model on
    ``device`` (exact always can)."""
    if backend == "exact":
        return
    flag = f"--attention {backend}"
    if not type(transformer).__module__.endswith("transformer_wan"):
        raise FlagError(f"{flag}: the approximate kernel serves Wan models only (this transformer is "
                        f"{type(transformer).__name__}); use --attention exact")
    why = fp8_attention.available(device)
    if why is not None:
        raise FlagError(f"{flag}: {why}; use --attention exact")
    head_dim = int((getattr(transformer, "config", {}) or {}).get("attention_head_dim", 0))
    if head_dim not in fp8_attention.HEAD_DIMS:
        raise FlagError(f"{flag}: the kernel takes head dims {list(fp8_attention.HEAD_DIMS)}, this model has "
                        f"{head_dim}; use --attention exact")


def report(transformer: torch.nn.Module, device: torch.device, dtype: torch.dtype | None,
           backend: str = "exact") -> dict[str, Any]:
    """The kernel SDPA runs for this transformer's heads on ``device`` (asked of torch's own
    dispatcher, ``_fused_sdp_choice``, on empty inputs of the model's shape); with an approximate
    ``backend`` (checked first), self-attention's kernel, its error, and SDPA's for the rest."""
    check(backend, transformer, device)
    config = getattr(transformer, "config", {}) or {}
    heads = int(config.get("num_attention_heads", 1))
    head_dim = int(config.get("attention_head_dim", 64))
    if dtype is None:  # the checkpoint's: the dtype most of the resident weights have (not the fp32 norms)
        counts: Counter[torch.dtype] = Counter()
        for t in transformer.parameters():
            if t.is_floating_point() and t.element_size() > 1:
                counts[t.dtype] += t.numel()
        dtype = counts.most_common(1)[0][0] if counts else torch.float32
    q = torch.empty(1, heads, 1024, head_dim, device=device, dtype=dtype)
    with chosen():
        picked = SDPBackend(torch._fused_sdp_choice(q, q, q))
    out = {"backend": picked.name.lower(), "order": [b.name.lower() for b in ORDER],
           "heads": heads, "head_dim": head_dim, "dtype": str(dtype).removeprefix("torch."), "why": WHY}
    if backend != "exact":
        out.update(backend=f"triton_{backend.replace('-', '_')}", approximate=True, error=ERROR[backend],
                   cross_attention=out["backend"])
    return out
