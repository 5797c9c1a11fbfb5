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

Its JIT compile is per process: every start compiled the kernel again. flash-attn-4 can keep the
compiled kernels on disk (its ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED``, off by default, read
at import); ``keep_cache`` turns it on under ``$DLOSERVE_CACHE/fa4`` (beside inductor's cache)
unless the environment says otherwise, so a restart loads what an earlier start compiled.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

MODULE = "flash_attn.cute"  # the wheel flash-attn-4's import name
DTYPES = (torch.bfloat16, torch.float16)
CACHE_ON = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"  # flash-attn-4's own switch ("1": on)
CACHE_DIR = "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"  # and folder (it adds its sources' hash)


def keep_cache() -> str | None:
    """Turn flash-attn-4's disk cache on under ``$DLOSERVE_CACHE/fa4`` where the environment
    sets neither variable; the folder, or None where the environment turned it off. Runs before
    ``flash_attn.cute`` imports (it reads both then)."""
    from .demo import cache_dir

    if os.environ.setdefault(CACHE_ON, "1") != "1":
        return None
    return os.environ.setdefault(CACHE_DIR, str(cache_dir() / "fa4"))


def cache_facts() -> dict[str, Any] | None:
    """The disk cache the imported kernel uses (None: flash-attn-4 not imported)."""
    utils = sys.modules.get("flash_attn.cute.cache_utils")
    if utils is None:
        return None
    on = bool(getattr(utils, "CUTE_DSL_CACHE_ENABLED", False))
    return {"on": on, "dir": str(utils.get_cache_path()) if on else None}


@cache
def _kernel() -> Callable[..., Any]:
    keep_cache()
    from flash_attn.cute import flash_attn_func

    return flash_attn_func


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
    out = _kernel()(q, k, v)
    return out[0] if isinstance(out, tuple) else out  # (out, lse)


@attend.register_fake
def _(q, k, v):  # noqa: ANN001, ANN202
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[3])
