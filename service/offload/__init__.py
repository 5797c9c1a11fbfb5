"""Distributed layerwise offload: pure torch + safetensors, usable on its own.

    from service.offload import OffloadMode, enable_layerwise_offload
    handle = enable_layerwise_offload(module, "model.safetensors", device="cuda", group=pg,
                                      mode=OffloadMode.ALLGATHER)

Names resolve on first use (``mode`` is plain data: the flag parsers import it without torch).
"""

from __future__ import annotations

from .lazy import lazy_names

_WHERE = {
    "ALIGN": "layout",
    "BlockLayout": "layout",
    "Checkpoint": "checkpoint",
    "CheckpointError": "files",
    "Fp8": "quant",
    "Fp8Compute": "quant",
    "LayerwiseOffload": "layerwise",
    "ModeChoice": "mode",
    "OffloadMode": "mode",
    "OffloadStats": "options",
    "Placement": "options",
    "ProbeTimings": "mode",
    "TensorEntry": "layout",
    "enable_layerwise_offload": "layerwise",
    "find_blocks": "modules",
    "load_resident": "modules",
    "plan_block": "layout",
}

__all__ = sorted(_WHERE)

__getattr__ = lazy_names(__name__, _WHERE)
