"""8-bit self-attention from cuDNN (``--attention fp8``): cuDNN's FP8 SDPA forward through
nvidia-cudnn-frontend's Python graph API (``pygraph.sdpa_fp8``); Hopper GPUs (sm90) only.

Why: measured on an H200 (issue 46; torch 2.11, cuDNN 9.19, B=1, H=40, D=128, q/k/v as
strided views of Wan's [B, S, H, D] layout, per-tensor e4m3 scales): 26.1 ms against 38.0 ms
for cuDNN's bf16 SDPA at 32,760 tokens (1.46x), 141 vs 207 ms at 75,600.

How, and the pitfalls that measurement found:

- q, k, v are quantized per tensor, the scale from the current amax (``quantize``). It is
  plain torch, so inside a compiled block inductor fuses the amax, the scale and the cast
  into the norm and RoPE that produce q and k (a separate quantization cost 4.2 ms a call).
- Flash-style FP8 quantizes P = exp(S - rowmax), which lies in (0, 1], with ``scale_s``:
  448 maps 1 to e4m3's largest value; more saturates P (error 0.06 at 448, 0.44 at 8 x 448,
  random inputs), so ``scales`` refuses a larger one.
- On Hopper the output must be FP8. O is a convex combination of V's rows, so |O| <= amax(V)
  and ``scale_o = 1 / descale_v`` never saturates; the caller gets O dequantized in plain
  torch (``attend``), where it is consumed (the projection after it).
- q, k, v and O are handed to cuDNN as strided views of [B, S, H, D] tensors in its
  [B, H, S, D] dims (``graph_spec``): no copies.

The cuDNN graph is built once per shape and strides (``_plan``) and runs as one custom op,
opaque to torch.compile. Everything but ``_plan`` and the op's body runs on the CPU too
(tests); the GPU path is checked by loadtest/gpu_check_attention.py (run on an H200 2026-12-05:
loadtest/results/h200-attention-check-2026-12-05-*.json).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
P_SCALE = FP8_MAX  # scale_s: P in (0, 1] -> (0, 448]; more saturates P
TINY = 1e-12  # an all-zero tensor's amax (its scale is then arbitrary and harmless)
HEAD_DIMS = (64, 128)
SCALARS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in e4m3 with one scale from its current amax, and the descale (amax / 448) that
    undoes it, fp32 [1, 1, 1, 1] (cuDNN's scalar shape). Plain torch: inductor fuses it."""
    amax = x.detach().abs().amax().float().clamp(min=TINY)
    return (x.float() * (FP8_MAX / amax)).to(FP8), (amax / FP8_MAX).reshape(1, 1, 1, 1)


@dataclass(frozen=True)
class Scales:
    """The six scalars cuDNN's FP8 SDPA reads, and O's descale (each fp32 [1, 1, 1, 1])."""

    descale_q: torch.Tensor
    descale_k: torch.Tensor
    descale_v: torch.Tensor
    descale_s: torch.Tensor
    scale_s: torch.Tensor
    scale_o: torch.Tensor
    descale_o: torch.Tensor

    def graph_inputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, n) for n in SCALARS)


def scales(descale_q: torch.Tensor, descale_k: torch.Tensor, descale_v: torch.Tensor,
           p_scale: float = P_SCALE) -> Scales:
    """The scalars from q, k, v's descales: P scaled by ``p_scale`` (448; ValueError above it,
    it saturates), O by 1 / descale_v (|O| <= amax(V): no saturation), O's descale descale_v."""
    if not 0 < p_scale <= FP8_MAX:
        raise ValueError(f"scale_s must be in (0, {FP8_MAX:g}] (P is quantized from (0, 1]; more "
                         f"saturates it), got {p_scale:g}")
    one = torch.ones_like(descale_v)
    return Scales(descale_q, descale_k, descale_v, one / p_scale, one * p_scale, 1.0 / descale_v, descale_v)


@dataclass(frozen=True)
class GraphSpec:
    """What the cuDNN graph is built from: dims and strides in cuDNN's [B, H, S, D] order of
    [B, S, H, D] tensors (views, no copies), O's too, and the softmax scale."""

    q: tuple[tuple[int, ...], tuple[int, ...]]
    k: tuple[tuple[int, ...], tuple[int, ...]]
    v: tuple[tuple[int, ...], tuple[int, ...]]
    o: tuple[tuple[int, ...], tuple[int, ...]]
    attn_scale: float


def _bhsd(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    b, s, h, d = t.shape
    sb, ss, sh, sd = t.stride()
    return (b, h, s, d), (sb, sh, ss, sd)


def graph_spec(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor) -> GraphSpec:
    """The graph's arguments for [B, S, H, D] e4m3 q, k, v (ValueError naming what does not fit)."""
    for name, t in (("q", q8), ("k", k8), ("v", v8)):
        if t.dim() != 4 or t.dtype != FP8:
            raise ValueError(f"{name} must be a 4-D [B, S, H, D] e4m3 tensor, got {tuple(t.shape)} {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s head dim must be contiguous (stride 1), got strides {t.stride()}")
    (b, s, h, d), (bk, sk, hk, dk), (bv, sv, hv, dv) = q8.shape, k8.shape, v8.shape
    if (b, h) != (bk, hk) or (bk, sk, hk) != (bv, sv, hv) or d != dk:
        raise ValueError(f"q {tuple(q8.shape)}, k {tuple(k8.shape)}, v {tuple(v8.shape)}: batch, heads and "
                         "q/k head dims must agree, k and v's lengths too")
    if d not in HEAD_DIMS or dv not in HEAD_DIMS:
        raise ValueError(f"head dims {d}/{dv}: cuDNN's FP8 attention is served here for {list(HEAD_DIMS)}")
    o = ((b, h, s, dv), (s * h * dv, dv, h * dv, 1))  # a fresh [B, S, H, Dv] tensor, seen as [B, H, S, Dv]
    return GraphSpec(_bhsd(q8), _bhsd(k8), _bhsd(v8), o, 1.0 / math.sqrt(d))


def emulate(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, s: Scales) -> torch.Tensor:
    """The FP8 recipe in fp32 torch (any device): P = exp(S - rowmax) quantized with scale_s, O
    normalized then quantized with scale_o; [B, S, H, D] e4m3. What the kernel should compute
    up to its accumulation order: the GPU check tells a kernel fault from the recipe's error."""
    q = q8.float().transpose(1, 2) * s.descale_q
    k = k8.float().transpose(1, 2) * s.descale_k
    v = v8.float().transpose(1, 2) * s.descale_v
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    p8 = (p * s.scale_s).to(FP8).float() * s.descale_s
    o = (p8 @ v) / p.sum(-1, keepdim=True)
    return (o * s.scale_o).to(FP8).transpose(1, 2)


# -- the GPU part ---------------------------------------------------------------------------

_PLANS: dict[tuple, Any] = {}
_HANDLES: dict[int, Any] = {}


def _plan(spec: GraphSpec, device: torch.device) -> Any:
    """The built cuDNN graph for ``spec`` (once per shape and strides) and its workspace."""
    import cudnn

    key = (spec, device.index)
    if key in _PLANS:
        return _PLANS[key]
    if device.index not in _HANDLES:
        _HANDLES[device.index] = cudnn.create_handle()
    handle = _HANDLES[device.index]
    e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32,
                          handle=handle)
    q, k, v = (graph.tensor(name=n, dim=list(d), stride=list(st), data_type=e4m3)
               for n, (d, st) in (("q", spec.q), ("k", spec.k), ("v", spec.v)))
    scalars = [graph.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32) for n in SCALARS]
    o, _stats, _amax_s, amax_o = graph.sdpa_fp8(q, k, v, *scalars, generate_stats=False,
                                                attn_scale=spec.attn_scale, name="sdpa_fp8")
    # Hopper: the output must be FP8. P's amax stays virtual: as an output it would restrict the
    # graph to cuDNN's backend engines (frontend 1.32's docstring); scale_s is fixed at 448.
    o.set_output(True).set_dim(list(spec.o[0])).set_stride(list(spec.o[1])).set_data_type(e4m3)
    amax_o.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=device)
    _PLANS[key] = plan = (graph, handle, (q, k, v, *scalars, o, amax_o), workspace)
    return plan


@torch.library.custom_op("dloserve::cudnn_fp8_attention", mutates_args=())
def _kernel(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, descale_q: torch.Tensor,
            descale_k: torch.Tensor, descale_v: torch.Tensor, descale_s: torch.Tensor, scale_s: torch.Tensor,
            scale_o: torch.Tensor) -> torch.Tensor:
    import cudnn

    spec = graph_spec(q8, k8, v8)
    graph, handle, tensors, workspace = _plan(spec, q8.device)
    b, s, h, _ = q8.shape
    out = torch.empty(b, s, h, v8.shape[-1], dtype=FP8, device=q8.device)
    amax_o = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=q8.device)
    data = (q8.transpose(1, 2), k8.transpose(1, 2), v8.transpose(1, 2), descale_q, descale_k, descale_v,
            descale_s, scale_s, scale_o, out.transpose(1, 2), amax_o)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q8.device).cuda_stream)
    graph.execute(dict(zip(tensors, data, strict=True)), workspace, handle=handle)
    return out


@_kernel.register_fake
def _(q8, k8, v8, descale_q, descale_k, descale_v, descale_s, scale_s, scale_o):  # noqa: ANN001, ANN202
    b, s, h, _ = q8.shape
    return q8.new_empty(b, s, h, v8.shape[-1])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Self-attention (no mask, softmax scale 1/sqrt(D)) of [B, S, H, D] q, k, v through cuDNN's
    FP8 SDPA; [B, S, H, D] in q's dtype. GPU only (service.models.attention_routes.available)."""
    q8, dq = quantize(q)
    k8, dk = quantize(k)
    v8, dv = quantize(v)
    s = scales(dq, dk, dv)
    o8 = _kernel(q8, k8, v8, *s.graph_inputs())
    return (o8.float() * s.descale_o.reshape(1, 1, 1, 1)).to(q.dtype)
