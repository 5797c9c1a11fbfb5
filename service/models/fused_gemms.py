"""GEMMs fused with their neighbours inside compiled blocks: Wan's q, k, v; diffusers' GELU.

Two fusions, each only while torch.compile traces (eager forwards keep diffusers' code) and only
where it is the same maths, rounding aside:

- ``qkv``: Wan's self-attention q, k, v projections as one GEMM three times as wide. diffusers
  runs them as three GEMMs of [tokens, 5120] x [5120, 5120] (Wan-14B); one is a little faster: a
  40-layer CFG step 0.5% (exact) and 0.2% (FP8 weights + fp8 attention) on an H100, 2026-12-05
  (loadtest/results/h100-attention-check-2026-12-05-fused-qkv.json). diffusers' own
  ``fuse_projections`` would keep a second, concatenated copy of every block's weights, which the
  offload's slots, LoRA and the FP8 weights do not know; here the three weights are concatenated
  inside the graph instead, one small copy kernel per block (157 MB bf16 at 5120, about 0.07 ms
  on an H200), from whatever tensors the block holds at that moment (a slot's, a resident
  block's). Plain ``nn.Linear`` or ``Fp8Linear`` on its FP8 GEMM (per-output-channel scales
  concatenate with the rows).
- ``gelu``: an FFN's up projection and its tanh GELU as one cuBLASLt GEMM with a GELU epilogue
  (``torch._addmm_activation``, which inductor keeps as one kernel): the [tokens, 13824]
  activation is written once instead of written, read and written again (3.6 GB a block call at
  32,760 tokens with CFG): a 40-layer CFG step 0.81% and 0.74% faster on two H100s, 2026-12-05
  (loadtest/results/h100-attention-check-2026-12-05-fusions-a.json and -baselines.json against
  -defaults.json). Any diffusers ``GELU`` module a compiled block calls takes it (Wan's FFN,
  Flux's double-stream FFN). CUDA only: torch's CPU kernel of the same op computes the erf GELU,
  not tanh. Plain ``nn.Linear`` with a bias, half precision: FP8 weights keep the GELU apart.

No hooks on the Linears in either (LoRA's side branches are hooks; a LoRA request runs eager
anyway). The patches are process-wide and counted: the last of overlapping users restores them.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from service.offload.quant import Fp8Compute, Fp8Linear, scaled_linear

WAN = "diffusers.models.transformers.transformer_wan"
ACTIVATIONS = "diffusers.models.activations"
FUSIONS = frozenset({"qkv", "gelu"})  # what a compiled block gets by default


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


def gelu_fusible(proj: nn.Module, approximate: str, device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``gelu_gemm`` is the same maths as diffusers' GELU for an input on ``device_type``
    of ``dtype``: a plain ``nn.Linear`` with a bias, the tanh GELU, half precision, CUDA."""
    return (type(proj) is nn.Linear and _plain(proj) and proj.bias is not None and approximate == "tanh"
            and device_type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and proj.weight.dtype == dtype)


def gelu_gemm(x: torch.Tensor, proj: nn.Module, approximate: str) -> torch.Tensor | None:
    """tanh-GELU(``proj``(``x``)) as one GEMM with a GELU epilogue; None where ``gelu_fusible``
    says no."""
    if not gelu_fusible(proj, approximate, x.device.type, x.dtype):
        return None
    out = torch._addmm_activation(proj.bias, x.reshape(-1, x.shape[-1]), proj.weight.t(), use_gelu=True)
    return out.view(*x.shape[:-1], proj.out_features)


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

    return get


@cache
def _gelu_forward(original: Any) -> Any:
    """diffusers' ``GELU.forward`` with the projection and the GELU as one GEMM while compiling."""

    def forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            out = gelu_gemm(hidden_states, self.proj, self.approximate)
            if out is not None:
                return out
        return original(self, hidden_states)

    return forward


_lock = threading.Lock()
_users: dict[tuple[int, str], tuple[int, Any]] = {}  # (id(owner), name) -> (users, the original)


@contextmanager
def _patched(owner: Any, name: str, make: Any) -> Iterator[None]:
    """``owner.name`` replaced by ``make(original)`` while anyone is inside (nothing where
    ``owner`` is None: that part of diffusers was not imported)."""
    if owner is None or getattr(owner, name, None) is None:
        yield
        return
    key = (id(owner), name)
    with _lock:
        users, original = _users.get(key, (0, getattr(owner, name)))
        if users == 0:
            setattr(owner, name, make(original))
        _users[key] = (users + 1, original)
    try:
        yield
    finally:
        with _lock:
            users, original = _users.pop(key)
            if users == 1:
                setattr(owner, name, original)
            else:
                _users[key] = (users - 1, original)


@contextmanager
def fused(which: frozenset[str] = FUSIONS) -> Iterator[None]:
    """The fusions named in ``which`` for the duration (an empty set: the measurement's baseline)."""
    unknown = which - FUSIONS
    if unknown:
        raise ValueError(f"unknown fusions {sorted(unknown)}; known: {sorted(FUSIONS)}")
    with ExitStack() as stack:
        if "qkv" in which:
            stack.enter_context(_patched(sys.modules.get(WAN), "_get_qkv_projections", _projections))
        if "gelu" in which:
            acts = sys.modules.get(ACTIVATIONS)
            stack.enter_context(_patched(getattr(acts, "GELU", None), "forward", _gelu_forward))
        yield
