"""A small DiT-like model for offload tests: odd block count, mixed dtypes per block."""

from __future__ import annotations

import torch
from torch import nn


class ToyBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=True)  # fp32 inside a bf16 block
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.scale_shift_table = nn.Parameter(torch.randn(2, dim))
        self.register_buffer("step_scale", torch.ones(dim))  # persistent buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shift, scale = self.scale_shift_table.unbind(0)
        h = self.norm(x.float()) * (1 + scale) + shift
        # the bias's dtype, not the weight's: a quantized weight is fp8
        h = self.fc2(torch.nn.functional.gelu(self.fc1(h.to(self.fc1.bias.dtype))))
        return x + h.to(x.dtype) * self.step_scale.to(x.dtype)


class ToyDiT(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 160, depth: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(16, dim)
        self.blocks = nn.ModuleList(ToyBlock(dim, hidden) for _ in range(depth))
        self.head = nn.Linear(dim, 16)
        self.register_buffer("freqs", torch.arange(dim, dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.to(self.embed.weight.dtype)) + self.freqs.to(self.embed.weight.dtype)
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)


def make_checkpoint(path: str, dim: int = 64, hidden: int = 160, depth: int = 5, seed: int = 0) -> None:
    """Random weights, bf16 except the fp32 norms/tables, saved as safetensors."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    m = ToyDiT(dim, hidden, depth)
    sd = {}
    for k, v in m.state_dict().items():
        v = torch.randn_like(v) * 0.05 + (1.0 if k.endswith("step_scale") else 0.0)
        if not (".norm." in k or k.endswith("scale_shift_table") or k.endswith("step_scale")):
            v = v.to(torch.bfloat16)
        sd[k] = v.contiguous()
    save_file(sd, path)


def empty_model(dim: int = 64, hidden: int = 160, depth: int = 5) -> ToyDiT:
    """The model with parameters on meta and real non-persistent buffers."""
    with torch.device("meta"):
        m = ToyDiT(dim, hidden, depth)
    m.freqs = torch.arange(dim, dtype=torch.float32)
    return m
