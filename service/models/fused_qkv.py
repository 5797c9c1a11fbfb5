"""Wan's self-attention q, k, v projections as one GEMM inside the compiled block.

diffusers runs them as three GEMMs of [tokens, 5120] x [5120, 5120] (Wan-14B); one GEMM three
times as wide is a little faster: a 40-layer CFG step 0.5% (exact) and 0.2% (FP8 weights + fp8
attention) on an H100, 2026-12-05 (loadtest/results/h100-attention-check-2026-12-05-fused-qkv.json).
diffusers' own ``fuse_projections`` would keep a second, concatenated copy of every block's
weights, which the offload's slots, LoRA and the FP8 weights do not know;
here the three weights are concatenated inside the compiled graph instead, one small copy
kernel per block (157 MB bf16 at 5120, about 0.07 ms on an H200), from whatever tensors the
block holds at that moment (a slot's, a resident block's).

Only where it is the same arithmetic: plain ``nn.Linear`` (bf16/fp16/fp32) or ``Fp8Linear``
on its FP8 GEMM (per-output-channel scales concatenate with the rows), no hooks on the
Linears (LoRA's side branches are hooks; a LoRA request runs eager anyway), and only while
torch.compile traces (eager forwards keep diffusers' three GEMMs).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from service.offload.quant import Fp8Compute, Fp8Linear, scaled_linear

WAN = "diffusers.models.transformers.transformer_wan"


def _plain(layer: nn.Module) -> bool:
    return not (layer._forward_hooks or layer._forward_pre_hooks)


def one_gemm(x: torch.Tensor, layers: tuple[nn.Module, ...]) -> torch.Tensor | None:
    """``layers`` applied to ``x`` as one GEMM, concatenated along the output; None where
    that would not be the same arithmetic as calling them one by one."""
    if not all(_plain(m) for m in layers):
        return None
    if all(type(m) is nn.Linear for m in layers):
        biases = [m.bias for m in layers]
        bias = torch.cat(biases) if all(b is not None for b in biases) else None  # type: ignore[arg-type]
        if bias is None and any(b is not None for b in biases):
            return None
        return F.linear(x, torch.cat([m.weight for m in layers]), bias)
    if all(type(m) is Fp8Linear and m.compute is Fp8Compute.SCALED_MM and m.gemm_ok for m in layers) \
            and x.dtype == torch.bfloat16:
        biases = [m.bias for m in layers]
        if any(b is None for b in biases) or len({b.dtype for b in biases}) != 1:  # type: ignore[union-attr]
            return None
        return scaled_linear(x, torch.cat([m.weight for m in layers]),
                              torch.cat([m.weight_scale for m in layers]), torch.cat(biases))  # type: ignore[arg-type]
    return None


@cache
def _projections(original: Any) -> Any:
    """diffusers' ``_get_qkv_projections`` with self-attention's three GEMMs made one while
    compiling (the same function object each time: dynamo guards on it)."""

    def get(attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None) -> Any:
        if encoder_hidden_states is None and not attn.fused_projections and torch.compiler.is_compiling():
            out = one_gemm(hidden_states, (attn.to_q, attn.to_k, attn.to_v))
            if out is not None:
                return out.chunk(3, dim=-1)
        return original(attn, hidden_states, encoder_hidden_states)

    get.fused = True  # type: ignore[attr-defined]
    return get


@contextmanager
def fused(on: bool = True) -> Iterator[None]:
    """Wan's q, k, v projections through ``one_gemm`` for the duration (nothing to do where
    no Wan model was imported, or with ``on`` False: the measurement's baseline)."""
    wan = sys.modules.get(WAN)
    if not on or wan is None or getattr(wan._get_qkv_projections, "fused", False):  # off, no Wan, or nested
        yield
        return
    original = wan._get_qkv_projections
    wan._get_qkv_projections = _projections(original)
    try:
        yield
    finally:
        wan._get_qkv_projections = original
