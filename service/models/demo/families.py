"""Demo checkpoints of the other Wan families, in the layouts diffusers publishes them in.

Each preset is assembled from diffusers/transformers classes with seeded random weights and
saved by the pipeline class's own ``save_pretrained`` (what ``from_pretrained`` reads back):

- ``wan-i2v-*`` (Wan2.1 I2V 14B): ``WanImageToVideoPipeline`` with a ``CLIPVisionModel`` image
  encoder and a ``CLIPImageProcessor``; the transformer takes 36 channels and an image context.
- ``wan22-t2v-*`` / ``wan22-a14b-shape`` (Wan2.2 A14B T2V): ``WanPipeline`` with ``transformer``
  and ``transformer_2`` (different weights) and ``boundary_ratio`` 0.875.
- ``wan22-i2v-*`` (Wan2.2 A14B I2V): ``WanImageToVideoPipeline``, two 36-channel experts,
  ``boundary_ratio`` 0.9, no image encoder.
- ``wan22-ti2v-*`` (Wan2.2 TI2V-5B): ``WanPipeline`` with ``expand_timesteps`` and the Wan2.2 VAE
  (``AutoencoderKLWan``: z_dim 48, residual, patch 2, 16x spatial; the published latent stats).

``*-tiny`` presets run a 2-step request on 2 CPU cores in seconds (CI). ``*-shape`` presets have
the real transformer block shapes in bf16 (``layers`` per expert), written block by block as
sharded checkpoints like ``wan14b-shape``; the other components stay small.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .parts import PRESETS, small_parts, tokenizer, write_streamed_transformer
from .parts import transformer_config as wan21_transformer_config

WAN14B = dict(heads=40, head_dim=128, ffn=13824, text_dim=4096, freq_dim=256, layers=12, vae_base=16,
              te_layers=1, dtype=torch.bfloat16)
TINY = dict(PRESETS["tiny"])
TI2V_5B = dict(heads=24, head_dim=128, ffn=14336, text_dim=4096, freq_dim=256, layers=30, vae_base=16,
               te_layers=1, dtype=torch.bfloat16)
# Wan2.2 VAE latent statistics (Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json).
WAN22_LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667]
WAN22_LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744]

# name -> transformer shapes, and how the family differs from Wan2.1 T2V
FAMILY_PRESETS: dict[str, dict[str, Any]] = {
    "wan-i2v-tiny": dict(TINY, pipeline="WanImageToVideoPipeline", in_channels=36, clip=32),
    "wan22-t2v-tiny": dict(TINY, pipeline="WanPipeline", experts=2, boundary_ratio=0.875),
    "wan22-i2v-tiny": dict(TINY, pipeline="WanImageToVideoPipeline", in_channels=36, experts=2,
                           boundary_ratio=0.9),
    "wan22-ti2v-tiny": dict(TINY, pipeline="WanPipeline", in_channels=48, vae22=True, expand_timesteps=True),
    "wan-i2v-14b-shape": dict(WAN14B, pipeline="WanImageToVideoPipeline", in_channels=36, clip=1280),
    "wan22-a14b-shape": dict(WAN14B, pipeline="WanPipeline", experts=2, boundary_ratio=0.875),
    "wan22-i2v-a14b-shape": dict(WAN14B, pipeline="WanImageToVideoPipeline", in_channels=36, experts=2,
                                 boundary_ratio=0.9),
    "wan22-ti2v-5b-shape": dict(TI2V_5B, pipeline="WanPipeline", in_channels=48, vae22=True,
                                expand_timesteps=True),
}
EXPERT_NAMES = ("transformer", "transformer_2")


def transformer_config(p: dict[str, Any], layers: int) -> dict[str, Any]:
    """The preset's WanTransformer3DModel config (Wan2.1 T2V's, with this family's changes)."""
    cfg = wan21_transformer_config(p, layers)
    channels = p.get("in_channels", 16)
    cfg.update(in_channels=channels, out_channels=48 if channels == 48 else 16)
    if p.get("clip"):  # Wan2.1 I2V: the image cross-attention's K/V projections
        cfg.update(image_dim=p["clip"], added_kv_proj_dim=p["heads"] * p["head_dim"])
    return cfg


def _vae22(base: int) -> Any:
    """A narrow Wan2.2 VAE: the published layout (z_dim 48, residual, patch 2, 16x spatial)."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=base, decoder_base_dim=base, z_dim=48, dim_mult=[1, 1, 1, 1],
                            num_res_blocks=1, temperal_downsample=[False, True, True], is_residual=True,
                            in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
                            scale_factor_temporal=4, latents_mean=WAN22_LATENTS_MEAN,
                            latents_std=WAN22_LATENTS_STD)


def _clip(hidden: int) -> dict[str, Any]:
    """A small CLIP image encoder of ``hidden`` width (Wan's image context is its hidden size)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    side = 32
    encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=2, image_size=side, patch_size=8))
    processor = CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    return {"image_encoder": encoder, "image_processor": processor}


def write_family(out: Path, preset: str, layers: int, seed: int, progress: bool, init_device: str) -> None:
    """Write ``preset`` (a FAMILY_PRESETS name) into the empty folder ``out``."""
    import diffusers
    from diffusers import WanTransformer3DModel

    p = FAMILY_PRESETS[preset]
    names = EXPERT_NAMES[: p.get("experts", 1)]
    streamed = p["dtype"] != torch.float32
    config = transformer_config(p, layers)
    tok = tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        parts = small_parts(p, len(tok))
        if p.get("vae22"):
            parts["vae"] = _vae22(p["vae_base"])
            sched = parts["scheduler"]  # TI2V-5B's published shift
            parts["scheduler"] = type(sched).from_config(sched.config, flow_shift=5.0)
        if p.get("clip"):
            parts.update(_clip(p["clip"]))
        denoisers = {n: None if streamed else WanTransformer3DModel(**config).eval() for n in names}
        settings = {k: p[k] for k in ("boundary_ratio", "expand_timesteps") if p.get(k)}
        pipe = getattr(diffusers, p["pipeline"])(tokenizer=tok, **parts, **denoisers, **settings)
        pipe.save_pretrained(out)
    if streamed:
        index_file = out / "model_index.json"
        index = json.loads(index_file.read_text())
        for i, name in enumerate(names):
            write_streamed_transformer(out / name, config, p["dtype"], seed + 100 * i, progress, init_device)
            index[name] = ["diffusers", "WanTransformer3DModel"]
        index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
