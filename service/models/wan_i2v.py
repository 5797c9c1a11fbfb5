"""Image-to-video: Wan2.1 I2V 14B and Wan2.2 A14B I2V, through ``WanImageToVideoPipeline``.

- **Wan2.1 I2V** (480p/720p 14B): the transformer takes 36 latent channels (16 noise, 4 mask,
  16 from the VAE-encoded image) and a CLIP image context: ``image_encoder``
  (``CLIPVisionModel``, ViT-H/14; its penultimate hidden states) and ``image_processor``
  (``CLIPImageProcessor``) are components, kept resident; each block has the extra
  ``add_k_proj``/``add_v_proj`` of the image cross-attention.
- **Wan2.2 A14B I2V**: two 36-channel experts split at ``boundary_ratio`` (0.9), no image
  encoder (the index names none).

Both need an image: a request without one is refused before any compute.
"""

from __future__ import annotations

from typing import Any

from .wan import WanAdapter, named, two_experts


class WanI2VAdapter(WanAdapter):
    """Wan2.1 I2V 14B: one transformer with CLIP image context."""

    family = "wan-i2v"
    pipeline_classes = ("WanImageToVideoPipeline",)
    components = WanAdapter.components + ("image_encoder", "image_processor")
    tasks = ("i2v",)
    image_input = "required"
    text_pipeline = None
    image_pipeline = "WanImageToVideoPipeline"

    @classmethod
    def accepts(cls, index: dict[str, Any]) -> bool:
        return not two_experts(index) and named(index, "image_encoder")


class Wan22I2VAdapter(WanAdapter):
    """Wan2.2 A14B I2V: two experts, the image through the VAE only."""

    family = "wan22-i2v"
    pipeline_classes = ("WanImageToVideoPipeline",)
    components = WanAdapter.components + ("transformer_2",)
    experts = ("transformer", "transformer_2")
    extra_args = WanAdapter.extra_args | {"guidance_scale_2"}
    tasks = ("i2v",)
    image_input = "required"
    text_pipeline = None
    image_pipeline = "WanImageToVideoPipeline"

    @classmethod
    def accepts(cls, index: dict[str, Any]) -> bool:
        return two_experts(index)
