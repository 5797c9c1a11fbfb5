"""Distributed layerwise offload: pure torch + safetensors, usable on its own.

    from service.offload import enable_layerwise_offload
    handle = enable_layerwise_offload(module, "model.safetensors", device="cuda", group=pg)
"""

from .checkpoint import Checkpoint, CheckpointError
from .layerwise import (
    LayerwiseOffload,
    OffloadStats,
    Placement,
    enable_layerwise_offload,
    find_blocks,
    load_resident,
)
from .layout import ALIGN, BlockLayout, TensorEntry, plan_block
from .quant import Fp8, Fp8Compute

__all__ = [
    "ALIGN",
    "BlockLayout",
    "Checkpoint",
    "CheckpointError",
    "Fp8",
    "Fp8Compute",
    "LayerwiseOffload",
    "OffloadStats",
    "Placement",
    "TensorEntry",
    "enable_layerwise_offload",
    "find_blocks",
    "load_resident",
    "plan_block",
]
