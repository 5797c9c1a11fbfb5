"""Test and benchmark adapters: real LoRA files for a Wan pipeline's transformer, random factors.

Nothing is downloaded here either. Two layouts, the two that people publish for Wan:

- ``peft``: diffusers/PEFT keys (``transformer.blocks.0.attn1.to_q.lora_A.weight``), written by
  diffusers' own ``WanPipeline.save_lora_weights`` with its adapter metadata (``r``,
  ``lora_alpha``) in the safetensors header, as a diffusers training script saves them;
- ``kohya``: the original Wan module names of the lightx2v / Kohya-style files
  (``diffusion_model.blocks.0.self_attn.q.lora_down.weight``, ``lora_up.weight``, a scalar
  ``alpha`` per module, ``diff_b`` bias deltas and zeroed norm ``diff`` keys), which
  ``load_lora_weights`` converts on load.

The factors are seeded noise of a size that changes the video visibly (B is not zero, unlike
a freshly initialised adapter).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

# diffusers module name (inside a block) -> the original Wan name (inside ``blocks.N``).
WAN_BLOCK_NAMES = {
    "attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o",
    "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k", "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o",
    "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2",
}
# Non-block Linears the conversion knows, diffusers name -> Wan name.
WAN_OTHER_NAMES = {
    "proj_out": "head.head",
    "condition_embedder.time_proj": "time_projection.1",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
}
LAYOUTS = ("peft", "kohya")


def linear_shapes(model_dir: str | os.PathLike) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every Linear of the pipeline's transformer (meta build)."""
    from ..registry import load_adapter

    module = load_adapter(model_dir).build_transformer()
    return {n: (m.in_features, m.out_features) for n, m in module.named_modules()
            if isinstance(m, torch.nn.Linear)}


def write_demo_lora(model_dir: str | os.PathLike, path: str | os.PathLike, *, rank: int = 4,
                    layout: str = "peft", seed: int = 0, alpha: float | None = None,
                    blocks_only: bool = False, dtype: torch.dtype = torch.float32,
                    device: str = "cpu", strength: float = 0.5) -> Path:
    """Write a LoRA for every Linear of the model's blocks (and, unless ``blocks_only``, the
    non-block Linears the conversion maps) to the file ``path``; returns it.

    ``alpha``: ``lora_alpha`` (peft: in the metadata) or every module's ``alpha`` (kohya);
    None: the rank (scale 1). ``strength`` sets the size of B's entries. ``device`` draws the
    factors there (a CUDA generator writes a 14B-shaped rank-64 adapter in seconds).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    shapes = linear_shapes(model_dir)
    gen = torch.Generator(device).manual_seed(seed)

    def factors(n_in: int, n_out: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.randn(rank, n_in, generator=gen, device=device) / n_in**0.5
        b = torch.randn(n_out, rank, generator=gen, device=device) * (strength / rank**0.5)
        return a.to("cpu", dtype), b.to("cpu", dtype)

    names = [n for n in shapes if n.startswith("blocks.")]
    if not blocks_only:
        names += [n for n in WAN_OTHER_NAMES if n in shapes]
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if layout == "peft":
        from diffusers import WanPipeline

        layers = {}
        for n in names:
            a, b = factors(*shapes[n])
            layers[f"{n}.lora_A.weight"], layers[f"{n}.lora_B.weight"] = a, b
        meta = {"r": rank, "lora_alpha": alpha if alpha is not None else rank,
                "target_modules": sorted(names), "lora_dropout": 0.0, "bias": "none"}
        WanPipeline.save_lora_weights(out.parent, transformer_lora_layers=layers, weight_name=out.name,
                                      transformer_lora_adapter_metadata=meta)
        return out
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for n in names:
        wan = _wan_name(n)
        if wan is None:
            continue
        a, b = factors(*shapes[n])
        key = f"diffusion_model.{wan}"
        tensors[f"{key}.lora_down.weight"], tensors[f"{key}.lora_up.weight"] = a, b
        if n.startswith("blocks."):  # the conversion reads an alpha for block modules only
            tensors[f"{key}.alpha"] = torch.tensor(float(alpha if alpha is not None else rank), dtype=dtype)
        diff_b = torch.randn(shapes[n][1], generator=gen, device=device) * 0.01
        tensors[f"{key}.diff_b"] = diff_b.to("cpu", dtype)
    for i in sorted({int(n.split(".")[1]) for n in names if n.startswith("blocks.")}):
        # lightx2v files carry zeroed norm deltas; the conversion drops them
        tensors[f"diffusion_model.blocks.{i}.norm3.diff"] = torch.zeros(4, dtype=dtype)
    save_file(tensors, out, metadata={"format": "pt", "dloserve_demo": json.dumps({"seed": seed})})
    return out


def _wan_name(name: str) -> str | None:
    if name in WAN_OTHER_NAMES:
        return WAN_OTHER_NAMES[name]
    _, index, rest = name.split(".", 2)
    return f"blocks.{index}.{WAN_BLOCK_NAMES[rest]}" if rest in WAN_BLOCK_NAMES else None
