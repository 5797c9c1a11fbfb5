"""FP8 weights for the streamed blocks: float8_e4m3fn, one fp32 scale per output channel.

Only ``nn.Linear`` weights inside the blocks are quantized; their biases, the norms, the
modulation tables and every non-block tensor keep their dtype. Those weights are nearly all
of a DiT block's bytes, so the host shards, the H2D copies, the AllGather and the two slots
carry about half the bytes of bf16.

Scales are powers of two (like the E8M0 scales of OCP microscaling): row r gets the
smallest 2^e with max|w_r| <= 448 * 2^e. Multiplying by a power of two is exact in bf16 and
fp32, so only the cast to fp8 rounds. That buys three things:

- quantizing a row depends on that row alone, exactly: rows quantized one range at a time
  (a rank's shard), the whole tensor at load, or the checkpoint offline (``dloserve
  quantize``) give the same bytes;
- dequantizing (q * scale) is exact in the compute dtype: no fp32 temporaries;
- the error is that of amax/448 scales (0.0265 vs 0.0264 relative, N(0, 1/45) weights).

Compute (``Fp8Compute``): UPCAST turns the fp8 weight into a compute-dtype weight on the
device right before its matmul (what runs on CPU, so CI covers it); SCALED_MM quantizes the
activations per token (power-of-two scales again) and runs one FP8 GEMM
(``torch._scaled_mm`` with row-wise scales); AUTO takes SCALED_MM on CUDA devices with FP8
tensor cores (capability 8.9 and up) and UPCAST elsewhere.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_SUFFIX = "_scale"  # "<linear>.weight" -> "<linear>.weight_scale"
_EXACT = (torch.bfloat16, torch.float32)  # 8-bit exponents: power-of-two products are exact
_MIN_EXP, _MAX_EXP = -126, 127  # scales stay normal fp32 (and bf16) numbers


class Fp8Compute(enum.StrEnum):
    """How a quantized Linear computes (see the module docstring)."""

    AUTO = "auto"
    UPCAST = "upcast"
    SCALED_MM = "scaled_mm"


@dataclass(frozen=True)
class Fp8:
    """``quantization=Fp8()`` (or ``"fp8"``): block Linear weights in float8_e4m3fn."""

    compute: Fp8Compute = Fp8Compute.AUTO

    name = "fp8"


NONE = "none"  # no quantization, said outright: an fp8 checkpoint is refused, not read as one


def as_quantization(value: str | Fp8 | None) -> Fp8 | str | None:
    """``None`` (the checkpoint's own), ``"none"``, ``"fp8"`` or an ``Fp8`` -> ``Fp8``,
    ``"none"`` or None; ValueError names the choices."""
    if value is None or isinstance(value, Fp8) or value == NONE:
        return value
    if value == "fp8":
        return Fp8()
    raise ValueError(f"quantization must be None, 'none' or 'fp8', got {value!r}")


def scale_key(weight_key: str) -> str:
    return weight_key + SCALE_SUFFIX


# -- the arithmetic -----------------------------------------------------------------------


def pow2_scales(amax: torch.Tensor, check: bool = True) -> torch.Tensor:
    """fp32 powers of two 2^e, the smallest with ``amax <= 448 * 2^e`` (1 where amax is 0).

    No division: with amax = m * 2^k (m in [0.5, 1)) and 448 = 0.875 * 2^9, e is k - 9 when
    m <= 0.875 and k - 8 otherwise. The scale is built from its exponent bits, exactly.
    ``check`` refuses inf/nan (weights, at load); activations skip it (a host sync per call).
    """
    amax = amax.float()
    if check and not bool(torch.isfinite(amax).all()):
        raise ValueError("cannot quantize to fp8: the tensor holds inf or nan")
    m, k = torch.frexp(amax)
    e = torch.where(m <= 0.875, k - 9, k - 8)
    e = torch.where(amax > 0, e, torch.zeros_like(e)).clamp(_MIN_EXP, _MAX_EXP)
    return ((e + 127) << 23).view(torch.float32)


def _exact_dtype(t: torch.Tensor) -> torch.dtype:
    return t.dtype if t.dtype in _EXACT else torch.float32


def weight_scales(w: torch.Tensor) -> torch.Tensor:
    """Per-output-channel (row) scales of a 2-D weight, fp32 [rows]."""
    return pow2_scales(w.abs().amax(dim=1))


def quantize_weight(w: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """``w`` [out, in] -> float8_e4m3fn [out, in] (``scales`` from ``weight_scales``).

    Row-local and deterministic: ``quantize_weight(w[a:b]) == quantize_weight(w)[a:b]``.
    """
    if w.dim() != 2:
        raise ValueError(f"fp8 quantization is per output channel of a 2-D weight, got {tuple(w.shape)}")
    s = weight_scales(w) if scales is None else scales
    dt = _exact_dtype(w)
    return (w.to(dt) * (1.0 / s).to(dt).unsqueeze(1)).to(FP8)


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale in ``dtype`` (exact for bf16 and fp32; fp16 goes through fp32)."""
    dt = dtype if dtype in _EXACT else torch.float32
    w = q.to(dt)
    w.mul_(scales.to(dt).unsqueeze(1))
    return w if dt == dtype else w.to(dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [tokens, features] -> (fp8, fp32 [tokens, 1] scales), one scale per token."""
    s = pow2_scales(x.abs().amax(dim=1, keepdim=True), check=False)
    dt = _exact_dtype(x)
    return (x.to(dt) * (1.0 / s).to(dt)).to(FP8), s


# -- the module ---------------------------------------------------------------------------


class Fp8Linear(nn.Module):
    """A Linear whose weight is float8_e4m3fn [out, in] with fp32 ``weight_scale`` [out].

    Not an ``nn.Linear`` subclass on purpose: code that treats the weight as a plain
    matrix (LoRA, projection fusing) must not take it for one. ``compute`` is resolved
    (UPCAST or SCALED_MM) when the module is set up; SCALED_MM runs for bf16 inputs, other
    inputs and shapes that are not multiples of 16 take UPCAST.
    """

    def __init__(self, in_features: int, out_features: int, bias: nn.Parameter | None,
                 compute: Fp8Compute = Fp8Compute.UPCAST, device: torch.device | str = "meta") -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8, device=device),
                                   requires_grad=False)
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32, device=device))
        self.bias = bias
        self.gemm_ok = in_features % 16 == 0 and out_features % 16 == 0  # _scaled_mm's K and N
        self.compute = compute

    @classmethod
    def like(cls, linear: nn.Linear, compute: Fp8Compute) -> Fp8Linear:
        return cls(linear.in_features, linear.out_features, linear.bias, compute)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute is Fp8Compute.SCALED_MM and self.gemm_ok and x.dtype == torch.bfloat16:
            return scaled_linear(x, self.weight, self.weight_scale, self.bias)
        return F.linear(x, dequantize(self.weight, self.weight_scale, x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, compute={self.compute.value}")


def scaled_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """x @ (q * s).T + bias as one FP8 GEMM: x quantized per token, q.T is column-major."""
    lead = x.shape[:-1]
    xq, xs = quantize_rows(x.reshape(-1, x.shape[-1]))
    fused = bias is not None and bias.dtype == torch.bfloat16
    out = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=scales.view(1, -1),
                           bias=bias if fused else None, out_dtype=torch.bfloat16)
    if bias is not None and not fused:
        out = out + bias
    return out.view(*lead, q.shape[0])


def resolve_compute(compute: Fp8Compute | str, device: torch.device) -> Fp8Compute:
    """AUTO -> SCALED_MM where FP8 tensor cores exist (CUDA capability >= 8.9), else UPCAST."""
    c = Fp8Compute(compute)
    if c is not Fp8Compute.AUTO:
        return c
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        return Fp8Compute.SCALED_MM
    return Fp8Compute.UPCAST


def quantize_blocks(blocks: Iterable[tuple[str, nn.Module]], compute: Fp8Compute) -> list[str]:
    """Swap every ``nn.Linear`` inside ``blocks`` for an ``Fp8Linear`` (on meta).

    Returns the full keys of the quantized weights (``<prefix><path>.weight``), in block
    order. Must run before the module's tensors are loaded: the new weights are on meta.
    """
    keys: list[str] = []
    for prefix, block in blocks:
        linears = [(n, m) for n, m in block.named_modules() if type(m) is nn.Linear]
        for name, lin in linears:
            parent, _, leaf = name.rpartition(".")
            setattr(block.get_submodule(parent) if parent else block, leaf, Fp8Linear.like(lin, compute))
            keys.append(f"{prefix}{name}.weight")
        if any(isinstance(m, nn.Linear) for m in block.modules()):
            raise ValueError(f"block {prefix!r} holds an nn.Linear subclass fp8 does not know how to replace")
    return keys


def set_compute(module: nn.Module, compute: Fp8Compute | str, device: torch.device) -> Fp8Compute:
    """Switch every ``Fp8Linear`` of ``module`` to ``compute`` (same weights); returns it resolved."""
    c = resolve_compute(compute, device)
    for m in module.modules():
        if isinstance(m, Fp8Linear):
            m.compute = c
    return c
