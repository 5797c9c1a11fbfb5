"""Wan2.2: the A14B text-to-video model (two experts) and TI2V-5B (text or text + image).

Both are published as ``WanPipeline`` folders; the index says which:

- **A14B T2V** names ``transformer`` (the high-noise expert) and ``transformer_2`` (the
  low-noise one) and a ``boundary_ratio`` (0.875): steps with timestep >= 875 run the
  first, the rest the second, each with its own guidance scale (``guidance_scale_2``,
  default ``guidance_scale``). Both experts stream through the same ring (experts.py).
- **TI2V-5B** has one transformer (dim 3072, 48 latent channels), the Wan2.2 VAE
  (``AutoencoderKLWan`` with z_dim 48, 16x spatial, patch 2: sizes are multiples of 32) and
  ``expand_timesteps``. Without an image it runs ``WanPipeline``; with one diffusers runs
  the same components through ``WanImageToVideoPipeline`` (no image encoder: the image is
  VAE-encoded into the first latent frame, whose timestep stays 0), which is what we call.
"""

from __future__ import annotations

from typing import Any

from .wan import WanAdapter, two_experts


class Wan22Adapter(WanAdapter):
    """Wan2.2 A14B T2V: two 14B experts split at ``boundary_ratio``."""

    family = "wan22-t2v"
    components = WanAdapter.components + ("transformer_2",)
    experts = ("transformer", "transformer_2")
    extra_args = WanAdapter.extra_args | {"guidance_scale_2"}

    @classmethod
    def accepts(cls, index: dict[str, Any]) -> bool:
        return two_experts(index) and not index.get("expand_timesteps")


class Wan22TI2VAdapter(WanAdapter):
    """Wan2.2 TI2V-5B: one 5B transformer, the Wan2.2 VAE, text or text + image."""

    family = "wan22-ti2v"
    tasks = ("t2v", "i2v")
    image_input = "optional"
    image_pipeline = "WanImageToVideoPipeline"

    @classmethod
    def accepts(cls, index: dict[str, Any]) -> bool:
        return bool(index.get("expand_timesteps")) and not two_experts(index)
