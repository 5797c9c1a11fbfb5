"""Which attention kernel runs, chosen on purpose and reported.

diffusers' Wan and Flux attention call ``F.scaled_dot_product_attention``; which fused kernel
torch dispatches it to depends on its priority order, the device, dtype and head size. The
order is set here, exact kernels only, fastest first as measured on an H200 at the Wan2.1-14B
shape (40 heads x 128, bf16; loadtest/results/h200-compute-2026-12-02.json, self + cross
attention of one block at 32,760 tokens): cuDNN 39.4 ms, flash 61.8 ms, memory-efficient
122.8 ms. What torch then picks for the model's own head shape and dtype is reported at load
(the log, ``describe()``, and ``/readyz``'s last start). Approximate kernels (SageAttention,
FP8 attention) are not used: the one measured (SageAttention 1) was slower than cuDNN.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

ORDER = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
         SDPBackend.MATH)
WHY = ("exact kernels, fastest first as measured on an H200 at 40 heads x 128 bf16: cuDNN 39.4 ms, "
       "flash 61.8 ms, memory-efficient 122.8 ms (self + cross attention of one block, 32,760 tokens)")


@contextmanager
def chosen() -> Iterator[None]:
    """SDPA with the priority order above (torch falls through to the next kernel where one
    does not support the inputs, e.g. cuDNN on the CPU)."""
    with sdpa_kernel(list(ORDER), set_priority=True):
        yield


def report(transformer: torch.nn.Module, device: torch.device, dtype: torch.dtype | None) -> dict[str, Any]:
    """The kernel SDPA runs for this transformer's heads on ``device`` (asked of torch's own
    dispatcher, ``_fused_sdp_choice``, on empty inputs of the model's shape)."""
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
    return {"backend": picked.name.lower(), "order": [b.name.lower() for b in ORDER],
            "heads": heads, "head_dim": head_dim, "dtype": str(dtype).removeprefix("torch."), "why": WHY}
