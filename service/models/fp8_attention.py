"""Approximate self-attention for Hopper GPUs: a flash-attention forward in Triton with 8-bit dots
(``--attention triton-fp8`` / ``int8-fp8``; GPU only: it needs CUDA, Triton and sm90). Kept behind
the choice while cuDNN's FP8 SDPA (``--attention fp8``, service.models.cudnn_fp8_attention) is
not yet measured against it on the H200; issue 46: delete it unless a case where it wins is.

Why: at Wan2.1-14B's shape (40 heads x 128, 32,760 tokens) exact attention (cuDNN, bf16) is
over half of a compiled block's time and already runs near the bf16 rate; Hopper's 8-bit
matrix units run twice as fast. Measured on an H200 (docs/benchmarks.md, "Approximate
attention"): 33.7 ms against cuDNN's 38.7-39.7 ms, mean relative error 0.05-0.10.

How: Q and K are quantized per token (one scale per row of each head; e4m3, or int8 with
``qk_int8``, which halves the error for 1.4 ms), V per channel (P @ V sums over tokens, so a
channel's scale comes out of the sum), P is scaled by 448 and cast to e4m3 for its dot (or
bf16, ``pv_fp8=False``). Softmax is online (running max, fp32), dots accumulate in fp32, the
softmax scale and log2(e) ride in Q's scales. The quantization is plain torch (inductor fuses
it into the block when compiled); the kernel is a custom op, opaque to torch.compile.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: ``available()`` says why the kernel cannot run
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
LOG2E = 1.4426950408889634
PAD = 256  # token counts are padded to this (every block size divides it); pads are masked
CONFIG = dict(block_m=64, block_n=128, num_warps=4, num_stages=3)  # fastest of 16 on the H200
HEAD_DIMS = (64, 128)


def available(device: torch.device) -> str | None:
    """None where the kernel runs on ``device``, else why not (attention_routes' rule)."""
    from .attention_routes import available as runs

    return runs("triton", device)


if triton is not None:
    @triton.jit
    def _step(q, qs, k_ptrs, ks_ptrs, v_ptrs, start, N, m_i, l_i, acc, BLOCK_N: tl.constexpr,
              D: tl.constexpr, PV_FP8: tl.constexpr, QK_INT8: tl.constexpr, MASK: tl.constexpr):
        """One block of keys: scores, the online softmax's update, P @ V."""
        k = tl.load(k_ptrs + start * D)
        ks = tl.load(ks_ptrs + start)
        if QK_INT8:
            s = tl.dot(q, k, out_dtype=tl.int32).to(tl.float32) * (qs[:, None] * ks[None, :])
        else:
            s = tl.dot(q, k) * (qs[:, None] * ks[None, :])
        if MASK:  # the last, partial block: its padded keys get no weight
            cols = start + tl.arange(0, BLOCK_N)
            s = tl.where(cols[None, :] < N, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = tl.load(v_ptrs + start)
        if PV_FP8:
            acc = tl.dot((p * 448.0).to(tl.float8e4nv), v, acc)
        else:
            acc = tl.dot(p.to(tl.bfloat16), v, acc)
        return m_new, l_i, acc

    @triton.jit
    def _fwd(Q, K, Vt, QS, KS, VS, Out, N, NP, H, so_b, so_n, so_h, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, D: tl.constexpr, PV_FP8: tl.constexpr, QK_INT8: tl.constexpr):
        """One program: BLOCK_M query rows of one (batch, head) against all keys."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.arange(0, BLOCK_N)
        rd = tl.arange(0, D)
        base = bh.to(tl.int64) * NP * D
        sbase = bh.to(tl.int64) * NP
        q = tl.load(Q + base + rm[:, None] * D + rd[None, :])
        qs = tl.load(QS + sbase + rm)
        k_ptrs = K + base + rn[None, :] * D + rd[:, None]  # K^T: [D, BLOCK_N], D contiguous
        v_ptrs = Vt + base + rd[None, :] * NP + rn[:, None]  # V: [BLOCK_N, D], tokens contiguous
        ks_ptrs = KS + sbase + rn
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        n_full = (N // BLOCK_N) * BLOCK_N
        for start in range(0, n_full, BLOCK_N):
            m_i, l_i, acc = _step(q, qs, k_ptrs, ks_ptrs, v_ptrs, start, N, m_i, l_i, acc,
                                  BLOCK_N, D, PV_FP8, QK_INT8, False)
        if n_full < N:
            m_i, l_i, acc = _step(q, qs, k_ptrs, ks_ptrs, v_ptrs, n_full, N, m_i, l_i, acc,
                                  BLOCK_N, D, PV_FP8, QK_INT8, True)
        vs = tl.load(VS + bh.to(tl.int64) * D + rd)
        if PV_FP8:
            vs = vs / 448.0
        out = acc / l_i[:, None] * vs[None, :]
        o_ptrs = Out + b.to(tl.int64) * so_b + rm[:, None].to(tl.int64) * so_n + h * so_h + rd[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=rm[:, None] < N)


def padded(n: int) -> int:
    """The kernel's token count for ``n`` tokens."""
    return -(-n // PAD) * PAD


def _quant_rows(x: torch.Tensor, extra: float, int8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, N, H, D] -> 8-bit [B, H, NP, D] (zero padded) and fp32 per-token scales [B, H, NP]
    (times ``extra``)."""
    b, n, h, d = x.shape
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / (127.0 if int8 else FP8_MAX)
    x8 = torch.zeros(b, h, padded(n), d, device=x.device, dtype=torch.int8 if int8 else FP8)
    x8[:, :, :n] = ((xf / scale).round().to(torch.int8) if int8 else (xf / scale).to(FP8)).transpose(1, 2)
    sc = torch.zeros(b, h, padded(n), device=x.device, dtype=torch.float32)
    sc[:, :, :n] = (scale * extra)[..., 0].transpose(1, 2)
    return x8, sc


def _quant_v(v: torch.Tensor, pv_fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, N, H, D] -> [B, H, D, NP] (tokens contiguous: the K-major operand 8-bit wgmma wants),
    e4m3 with per-channel scales [B, H, D], or bf16 with scales of one."""
    b, n, h, d = v.shape
    vt = torch.zeros(b, h, d, padded(n), device=v.device, dtype=FP8 if pv_fp8 else torch.bfloat16)
    if not pv_fp8:
        vt[..., :n] = v.to(torch.bfloat16).permute(0, 2, 3, 1)
        return vt, torch.ones(b, h, d, device=v.device, dtype=torch.float32)
    vf = v.float()
    scale = vf.abs().amax(1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # [B, 1, H, D]
    vt[..., :n] = (vf / scale).to(FP8).permute(0, 2, 3, 1)
    return vt, scale[:, 0].contiguous()


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_int8: bool = False,
             pv_fp8: bool = True) -> tuple[torch.Tensor, ...]:
    """The kernel's inputs from [B, N, H, D] q, k, v (plain torch: runs anywhere)."""
    q8, qs = _quant_rows(q, LOG2E / math.sqrt(q.shape[-1]), qk_int8)
    k8, ks = _quant_rows(k, 1.0, qk_int8)
    vt, vs = _quant_v(v, pv_fp8)
    return q8, k8, vt, qs, ks, vs


def dequantize(q8: torch.Tensor, scales: torch.Tensor, n: int, extra: float = 1.0) -> torch.Tensor:
    """``_quant_rows``' inverse, [B, N, H, D] fp32 (tests and error studies)."""
    return (q8.float() * (scales / extra)[..., None])[:, :, :n].transpose(1, 2)


@torch.library.custom_op("dloserve::lowp_attention", mutates_args=())
def _kernel(q8: torch.Tensor, k8: torch.Tensor, vt: torch.Tensor, qs: torch.Tensor, ks: torch.Tensor,
            vs: torch.Tensor, n: int, out_dtype: torch.dtype, block_m: int, block_n: int,
            num_warps: int, num_stages: int) -> torch.Tensor:
    b, h, np_, d = q8.shape
    out = torch.empty(b, n, h, d, device=q8.device, dtype=out_dtype)
    _fwd[(np_ // block_m, b * h)](
        q8, k8, vt, qs, ks, vs, out, n, np_, h, out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=block_m, BLOCK_N=block_n, D=d, PV_FP8=vt.dtype == FP8, QK_INT8=q8.dtype == torch.int8,
        num_warps=num_warps, num_stages=num_stages)
    return out


@_kernel.register_fake
def _(q8, k8, vt, qs, ks, vs, n, out_dtype, block_m, block_n, num_warps, num_stages):  # noqa: ANN001, ANN202
    b, h, _, d = q8.shape
    return q8.new_empty(b, n, h, d, dtype=out_dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_int8: bool = False,
           pv_fp8: bool = True, **config: int) -> torch.Tensor:
    """Self-attention (no mask, one softmax scale of 1/sqrt(D)) of [B, N, H, D] q, k, v of one
    shape; [B, N, H, D] in q's dtype. GPU only (``available``)."""
    cfg = {**CONFIG, **config}
    return _kernel(*quantize(q, k, v, qk_int8, pv_fp8), q.shape[1], q.dtype, cfg["block_m"], cfg["block_n"],
                   cfg["num_warps"], cfg["num_stages"])
