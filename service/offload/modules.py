"""Module plumbing: which ModuleLists stream, what the module expects, the resident reference.

Also the two hooks that run a host-kept embedding on the host: inputs go to the host, the
looked-up rows come back to the device (a lookup is an exact copy on any device).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from .checkpoint import Checkpoint, compute_aligned, serving_dtype
from .files import CheckpointError
from .quant import NONE, Fp8
from .quant_checkpoint import prequantized_key, quantize_module
from .runtime import set_tensor


def find_blocks(module: nn.Module, block_attrs: Sequence[str] | None) -> list[tuple[str, nn.Module]]:
    """The blocks to stream, in run order, as (state_dict prefix, module)."""
    if block_attrs:
        lists = []
        for attr in block_attrs:
            try:
                ml = module.get_submodule(attr)
            except AttributeError as e:
                raise ValueError(f"block_attrs: module has no submodule {attr!r}") from e
            if not isinstance(ml, nn.ModuleList):
                raise ValueError(f"block_attrs: {attr!r} is {type(ml).__name__}, not a ModuleList")
            lists.append((attr, ml))
    else:
        candidates = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.ModuleList) and n]
        if not candidates:
            raise ValueError("module has no ModuleList of blocks; pass block_attrs")

        def size(m: nn.Module) -> int:
            return sum(p.numel() for p in m.parameters())

        lists = [max(candidates, key=lambda nm: size(nm[1]))]
    return [(f"{attr}.{i}.", blk) for attr, ml in lists for i, blk in enumerate(ml)]


def _expected(module: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict(keep_vars=True).items()}


def _place_non_persistent(module: nn.Module, dev: torch.device, persistent: Iterable[str]) -> None:
    keep = set(persistent)
    for name, buf in list(module.named_buffers()):
        if name in keep or buf is None:
            continue
        if buf.is_meta:
            raise CheckpointError(
                f"buffer {name!r} is not saved in checkpoints and is still on the meta device: "
                "build the module with accelerate.init_empty_weights() so buffers stay real"
            )
        set_tensor(module, name, buf.to(dev))


def _to_host(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)


def _back_to(dev: torch.device) -> Callable[[nn.Module, tuple, torch.Tensor], torch.Tensor]:
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output.to(dev)

    return hook


def load_resident(
    module: nn.Module,
    checkpoint: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    keep_fp32: Iterable[str] = (),
    *,
    quantization: str | Fp8 | None = None,
    block_attrs: Sequence[str] | None = None,
) -> nn.Module:
    """Load the whole checkpoint onto ``device`` (the fully resident reference).

    On CPU in the checkpoint's dtype the tensors stay zero-copy mmap views where they lie on
    a 64-byte boundary; the others are copied (``compute_aligned``: equal bytes whatever the
    file's offsets). ``quantization``
    makes the Linears of the blocks (``block_attrs``, as ``find_blocks``) fp8, as the
    offload does.
    """
    dev = torch.device(device)
    ckpt = Checkpoint(checkpoint)
    # find_blocks only for fp8 (asked for, or the checkpoint's own): a module with no block
    # list still loads unquantized
    fp8 = quantization not in (None, NONE) or (quantization is None and prequantized_key(ckpt) is not None)
    blocks = find_blocks(module, block_attrs) if fp8 else []
    quant = quantize_module(module, blocks, ckpt, quantization, dev)
    expected = _expected(module)
    ckpt.validate(expected)
    keep = tuple(keep_fp32) + (quant.keep_fp32 if quant else ())
    for key, rec in ckpt.records.items():
        t = ckpt.view(key).to(dev, serving_dtype(key, rec.dtype, dtype, keep))
        set_tensor(module, key, compute_aligned(t))
    _place_non_persistent(module, dev, expected)
    return module
