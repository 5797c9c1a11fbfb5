"""How each strategy of the offload benchmark loads the Wan transformer.

``load`` returns (module, handle-or-None) on the target device. The peers use
their own public APIs the way their docs show: diffusers ``from_pretrained`` then
``apply_group_offloading``; PyTorch FSDP2 ``fully_shard`` per block with
``CPUOffloadPolicy(pin_memory=True)`` and explicit forward prefetch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

STRATEGIES = ("resident", "dlo", "dlo-ranklocal", "diffusers-group", "fsdp2")
CPU_STRATEGIES = ("resident", "dlo", "dlo-ranklocal")


def meta_transformer(folder: Path) -> nn.Module:
    """The Wan transformer of ``folder``'s config on the meta device: dloserve's loaders fill it."""
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    with init_empty_weights():
        return WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(folder)).eval()


def keep_fp32() -> tuple[str, ...]:
    """The modules Wan keeps in fp32 when the rest is cast (its norms)."""
    from diffusers import WanTransformer3DModel

    return tuple(WanTransformer3DModel._keep_in_fp32_modules or ())


def load(strategy: str, folder: Path, device: torch.device) -> tuple[nn.Module, Any]:
    """The transformer in ``folder`` (diffusers layout), ready to run on ``device``."""
    from service.offload import OffloadMode, enable_layerwise_offload, load_resident

    if strategy == "resident":
        return load_resident(meta_transformer(folder), folder, device), None
    if strategy in ("dlo", "dlo-ranklocal"):
        module = meta_transformer(folder)
        mode = OffloadMode.ALLGATHER if strategy == "dlo" else OffloadMode.RANK_LOCAL
        handle = enable_layerwise_offload(module, folder, device=device, block_attrs=["blocks"], mode=mode)
        return module, handle
    if strategy == "diffusers-group":
        from diffusers import WanTransformer3DModel
        from diffusers.hooks import apply_group_offloading

        module = WanTransformer3DModel.from_pretrained(folder, torch_dtype=torch.bfloat16).eval()
        apply_group_offloading(module, onload_device=device, offload_device=torch.device("cpu"),
                               offload_type="block_level", num_blocks_per_group=1, use_stream=True,
                               record_stream=True)
        return module, None
    if strategy == "fsdp2":
        return _fsdp2(folder, device), None
    raise ValueError(f"unknown strategy {strategy!r}; one of {STRATEGIES}")


def _fsdp2(folder: Path, device: torch.device) -> nn.Module:
    import torch.distributed as dist
    from diffusers import WanTransformer3DModel
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    mesh = init_device_mesh("cuda", (1,))
    module = WanTransformer3DModel.from_pretrained(folder, torch_dtype=torch.bfloat16).eval()
    # FSDP2 insists on one dtype among *trainable* params; Wan keeps fp32 norms inside
    # bf16 blocks, so freeze everything (this is inference) to keep the dtypes as stored.
    module.requires_grad_(False)
    policy = CPUOffloadPolicy(pin_memory=True)
    blocks = list(module.blocks)
    for blk in blocks:
        fully_shard(blk, mesh=mesh, offload_policy=policy, reshard_after_forward=True)
    fully_shard(module, mesh=mesh, offload_policy=policy, reshard_after_forward=True)
    for cur, nxt in zip(blocks, blocks[1:], strict=False):
        cur.set_modules_to_forward_prefetch([nxt])
    return module
