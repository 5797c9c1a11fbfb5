"""Sequence parallelism (Ulysses) for one request across S ranks, through diffusers' own code.

diffusers 0.42 ships context parallelism for ``WanTransformer3DModel``: its ``_cp_plan``
splits the patch tokens (and the RoPE tables) S ways before block 0 and gathers them after
``proj_out``; inside each self-attention ``TemplatedUlyssesAttention`` turns the sequence
split into a head split with one all-to-all for each of Q, K, V and one for the output.
Cross-attention (text K/V) stays local. We call that code as it is; only the set-up differs:
``ModelMixin.enable_parallelism`` computes ``rank % torch.accelerator.device_count()``,
which divides by zero on a CPU-only torch, so ``enable_sequence_parallel`` builds the same
``ParallelConfig`` and mesh itself and then does what ``enable_parallelism`` does.

The S ranks of an SP group are one torch.distributed world (a Ray group, or the processes
``dloserve generate`` spawns): the mesh is built over that world, and the layerwise offload
of the same ranks gathers each block over it (each rank holds 1/S of the host copy).

Only Ulysses is wired: its degree must divide the attention heads. Ring attention (for
head counts S does not divide) needs the attention op to return its log-sum-exp, which
diffusers' native SDPA backend does not do; that is refused at load, naming the flag.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a rank applies the split: the front end checks shapes only
    from torch import nn

FLAG = "--sequence-parallel-size"


class SequenceParallelError(ValueError):
    """A model or setting sequence parallelism cannot serve; the message names the flag."""


def check_heads(heads: int, degree: int) -> None:
    """Ulysses hands each rank heads/S heads: S must divide the model's head count."""
    if degree < 1:
        raise SequenceParallelError(f"{FLAG} must be >= 1, got {degree}")
    if heads % degree:
        raise SequenceParallelError(
            f"{FLAG} {degree} does not divide the model's {heads} attention heads (Ulysses splits "
            "heads S ways; ring attention for other sizes is not supported by diffusers' native "
            "attention backend)"
        )


def split_hint(tokens: tuple[int, int, int], degree: int) -> str | None:
    """Why a (latent frames, rows, cols) token grid cannot be split ``degree`` ways, or None.

    The split is along the flattened token axis, so only the product must divide; the
    message says which frame counts would do with the same size.
    """
    frames, rows, cols = tokens
    total = frames * rows * cols
    if total % degree == 0:
        return None
    need = degree // math.gcd(rows * cols, degree)  # latent frames must be a multiple of this
    return (
        f"{frames} latent frames x {rows} x {cols} patches = {total} tokens do not split evenly "
        f"across {degree} sequence-parallel ranks: choose num_frames whose latent frame count "
        f"((num_frames-1)/4+1 for Wan) is a multiple of {need}, or a height/width whose patch "
        f"grid is a multiple of {degree}"
    )


def enable_sequence_parallel(module: nn.Module, degree: int) -> object:
    """Apply diffusers' Ulysses context parallelism over the current torch.distributed world.

    Every rank of the world calls this once, after the weights are in place (offload hooks
    and diffusers' CP hooks wrap different calls and do not interfere). Returns diffusers'
    ``ParallelConfig``.
    """
    import torch
    import torch.distributed as dist
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise SequenceParallelError(f"{FLAG} {degree}: torch.distributed is not initialised")
    world = dist.get_world_size()
    if world != degree:
        raise SequenceParallelError(f"{FLAG} {degree}: the process group has {world} ranks; an SP "
                                    "group must be its own world")
    plan = getattr(module, "_cp_plan", None)
    if not plan:
        raise SequenceParallelError(f"{FLAG}: {type(module).__name__} has no context-parallel plan")
    if getattr(module, "_parallel_config", None) is not None:
        raise SequenceParallelError(f"{FLAG}: parallelism is already applied to this module")
    heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
    if heads is not None:
        check_heads(int(heads), degree)
    device = next((p.device for p in module.parameters() if p.device.type != "meta"), torch.device("cpu"))
    cp = ContextParallelConfig(ulysses_degree=degree)
    config = ParallelConfig(context_parallel_config=cp)
    mesh = init_device_mesh(device.type, (1, degree), mesh_dim_names=cp.mesh_dim_names)
    config.setup(dist.get_rank(), world, device, mesh=mesh)
    module._parallel_config = config
    for m in module.modules():  # what enable_parallelism does for each attention processor
        processor = getattr(m, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = config
    # Wan2.1's timestep is one value per sample: the plan's per-token timestep split (for
    # Wan2.2 TI2V) is skipped with a warning on every forward; it is expected here.
    logging.getLogger("diffusers.hooks.context_parallel").setLevel(logging.ERROR)
    apply_context_parallel(module, cp, plan)
    return config


