"""Exact attention from flash-attn-4 (PyPI ``flash-attn-4``, import ``flash_attn.cute``; CuTe
DSL, JIT-compiled at its first call of a shape class, sm90 forward), as one custom op.

Why: measured on an H200 (issue 46, same run as cuDNN; 40 heads x 128, bf16): 33.1 ms against
cuDNN SDPA's 38.7 at 32,760 tokens (665 TFLOP/s, 1.17x), 1.18x at 75,600, error at bf16 level
(0.0023 relative to cuDNN), first call 1.6 s. Which shapes it serves is measured on the device
(service.models.attention_routes), not assumed.

Its layout is Wan's [B, S, H, D] (diffusers' dispatch hands q, k, v over so): no transposes.
The op is opaque to torch.compile (its fake gives the output's shape), so a compiled block
traces without running the DSL. GPU only; checked on an H200 by loadtest/gpu_check_attention.py
(2026-12-05: 0.0031 relative to cuDNN, 1.17-1.19x at 32,760 and 75,600 tokens).
"""

from __future__ import annotations

import torch

MODULE = "flash_attn.cute"  # the wheel flash-attn-4's import name
DTYPES = (torch.bfloat16, torch.float16)


def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel takes these [B, S, H, D] inputs: half precision, the same batch and
    heads, head dims 8-256 in multiples of 8 (its sm90 range), the head dim contiguous."""
    return (q.dim() == k.dim() == v.dim() == 4 and q.dtype in DTYPES and q.dtype == k.dtype == v.dtype
            and q.shape[0] == k.shape[0] == v.shape[0] and q.shape[2] == k.shape[2] == v.shape[2]
            and k.shape[1] == v.shape[1] and q.shape[3] == k.shape[3]
            and all(8 <= t.shape[3] <= 256 and t.shape[3] % 8 == 0 and t.stride(-1) == 1 for t in (q, k, v)))


@torch.library.custom_op("dloserve::fa4_attention", mutates_args=())
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unmasked attention, softmax scale 1/sqrt(D), of [B, S, H, D] q, k, v; [B, S, H, Dv]."""
    from flash_attn.cute import flash_attn_func

    out = flash_attn_func(q, k, v)
    return out[0] if isinstance(out, tuple) else out  # (out, lse)


@attend.register_fake
def _(q, k, v):  # noqa: ANN001, ANN202
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[3])
