"""Components beside the transformer: text encoders streamed block by block, VAEs staged.

``components`` names what goes through the offload runtime: ``dit`` (the transformer,
always, when offload is on), ``text_encoder`` (its block list streams through two slots
that exist only while it runs; its token embedding stays on the host, where a lookup is
as exact as on the device) and ``vae`` (pinned host memory, on the device only from the
last denoising step through decode). For Wan2.1-14B that moves the UMT5-XXL encoder
(about 11 GB in bf16) and the VAE off the device between uses.

The text encoder is built on the meta device and served in the dtypes transformers'
``from_pretrained`` would give it (the config's dtype, fp32 modules kept fp32), so its
embeddings, and so the MP4 bytes, are those of the resident encoder.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from service.config.offload import COMPONENTS, parse_components
from service.offload import LayerwiseOffload, OffloadMode, Placement, enable_layerwise_offload
from service.offload.checkpoint import Checkpoint

__all__ = ["COMPONENTS", "from_pretrained_dtype", "load_streamed_text_encoder", "parse_components"]


def from_pretrained_dtype(cls: type, config: Any, ckpt: Checkpoint) -> tuple[torch.dtype, tuple[str, ...]]:
    """The main dtype and fp32-kept modules ``cls.from_pretrained(folder)`` would use.

    transformers >= 5 loads with dtype "auto": the config's dtype, else the checkpoint's
    first floating dtype. Older versions load in the default dtype (fp32).
    """
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if dtype is None:
            dtype = next((r.dtype for r in ckpt.records.values() if r.dtype.is_floating_point),
                         torch.get_default_dtype())
    else:
        dtype = torch.get_default_dtype()
    keep: list[str] = []
    if dtype == torch.float16:
        keep += list(getattr(cls, "_keep_in_fp32_modules", None) or ())
    if dtype in (torch.float16, torch.bfloat16):
        keep += list(getattr(cls, "_keep_in_fp32_modules_strict", None) or ())
    return dtype, tuple(keep)


def _tied(module: nn.Module, ckpt: Checkpoint) -> dict[str, str]:
    """alias -> source for tied weights the checkpoint stores once (T5/UMT5: the embedding).

    transformers >= 5 declares them as a dict; older versions tie ``*.embed_tokens.weight``
    to ``shared.weight`` (what the fallback covers).
    """
    declared = getattr(module, "_tied_weights_keys", None)
    out = dict(declared) if isinstance(declared, dict) else {}
    for key in module.state_dict():
        if key.endswith("embed_tokens.weight") and "shared.weight" in ckpt.records:
            out.setdefault(key, "shared.weight")
    return {a: s for a, s in out.items() if a not in ckpt.records and s in ckpt.records}


def load_streamed_text_encoder(
    cls: type, folder: Any, device: torch.device, block_attrs: tuple[str, ...]
) -> tuple[nn.Module, LayerwiseOffload]:
    """A transformers text encoder whose ``block_attrs`` stream from the mmap (rank-local)."""
    from .meta import empty_weights

    config = cls.config_class.from_pretrained(folder)
    ckpt = Checkpoint(folder)
    dtype, keep = from_pretrained_dtype(cls, config, ckpt)
    with empty_weights():
        module = cls(config).eval()
    in_blocks = tuple(f"{a}." for a in block_attrs)
    host = tuple(n for n, m in module.named_modules()
                 if isinstance(m, nn.Embedding) and n and not n.startswith(in_blocks))
    # Rank-local and group=None: a text encoder runs when its rank's request does, not in
    # lock-step with the other ranks, so its fills must not be collectives.
    handle = enable_layerwise_offload(
        module, folder, device=device, group=None, mode=OffloadMode.RANK_LOCAL, block_attrs=list(block_attrs),
        dtype=dtype, keep_fp32=keep,
        placement=Placement(tied=_tied(module, ckpt), host_modules=host, free_slots=True),
    )
    ckpt.close()
    return module, handle
