"""Flux text-to-image: diffusers' own ``FluxPipeline`` with our transformer plugged in.

Two block lists are streamed, in run order: the double-stream ``transformer_blocks``
then the ``single_transformer_blocks``. Flux-dev's guidance is distilled into the
transformer (an embedding, not a second forward), so a request makes exactly one
transformer forward per step whatever ``guidance_scale`` is; true CFG
(``true_cfg_scale``) is not exposed. The image comes back as a one-frame video.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .adapter import LatentsCallback, ModelAdapter, ModelError, StepCallback, frames_to_uint8
from .request import GenerationRequest, RequestError

if TYPE_CHECKING:  # torch loads with the run: the front end reads the card only
    import numpy as np
    import torch
    from torch import nn


class FluxAdapter(ModelAdapter):
    """Flux.1 dev/schnell T2I."""

    family = "flux-t2i"
    tasks = ("t2i",)
    pipeline_classes = ("FluxPipeline",)
    block_attrs = ("transformer_blocks", "single_transformer_blocks")
    components = (
        "transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "scheduler"
    )
    extra_args = frozenset({"max_sequence_length"})
    text_encoder_blocks = {"text_encoder_2": ("encoder.block",)}  # T5-XXL; CLIP stays resident

    def __init__(self, model_dir: Path, index: dict[str, Any]) -> None:
        super().__init__(model_dir, index)
        try:
            vae_config = json.loads((model_dir / "vae" / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ModelError(f"{model_dir / 'vae' / 'config.json'}: cannot read config: {e}") from e
        # FluxPipeline: latents are packed 2x2, so sizes are multiples of 2 x the VAE's factor.
        self.multiple = 2 ** (len(vae_config.get("block_out_channels", [0] * 4)) - 1) * 2
        self._parts: dict[str, Any] = {}

    def forwards(self, req: GenerationRequest) -> int:
        return req.num_inference_steps  # guidance is an embedding: one forward per step

    def validate(self, req: GenerationRequest) -> None:
        super().validate(req)
        for name in ("height", "width"):
            if getattr(req, name) % self.multiple:
                raise RequestError(name, f"must be a multiple of {self.multiple}, got {getattr(req, name)}")
        if req.num_frames != 1:
            raise RequestError("num_frames", f"must be 1 for an image model, got {req.num_frames}")
        # Fields Flux would silently ignore are refused rather than dropped.
        if req.negative_prompt:
            raise RequestError("negative_prompt", "Flux (distilled guidance) takes no negative prompt")
        if req.flow_shift is not None:
            raise RequestError("flow_shift", "Flux derives its shift from the image size")
        msl = req.extra.get("max_sequence_length", 512)
        if isinstance(msl, bool) or not isinstance(msl, int) or not 1 <= msl <= 512:
            raise RequestError("extra.max_sequence_length", f"must be an integer in [1, 512], got {msl!r}")

    def load_components(self, device: torch.device, components: tuple[str, ...] = ("dit",)) -> None:
        self._parts = {
            name: self.load_part(name, device, components) if name.startswith(("text_encoder", "vae"))
            else self.load_component(name)
            for name in ("tokenizer", "tokenizer_2", "text_encoder", "text_encoder_2", "vae", "scheduler")
        }

    def run(
        self, transformer: nn.Module, req: GenerationRequest, on_step: StepCallback | None,
        on_latents: LatentsCallback | None = None,
    ) -> np.ndarray:
        import torch
        from diffusers import FluxPipeline

        base = self._parts["scheduler"]
        parts = {k: v for k, v in self._parts.items() if k != "scheduler"}
        pipe = FluxPipeline(transformer=transformer, scheduler=type(base).from_config(base.config), **parts)
        pipe.set_progress_bar_config(disable=True)

        step = self.step_callback(on_step, req.num_inference_steps)

        def callback(_pipe: Any, i: int, _t: Any, _kwargs: dict) -> dict:
            step(i + 1, req.num_inference_steps, _kwargs.get("latents"))
            return {}

        try:
            out = pipe(
                prompt=req.prompt,
                height=req.height,
                width=req.width,
                num_inference_steps=req.num_inference_steps,
                guidance_scale=req.guidance_scale,
                generator=torch.Generator("cpu").manual_seed(req.seed),
                output_type="pt",
                callback_on_step_end=callback,
                max_sequence_length=req.extra.get("max_sequence_length", 512),
            )
            return frames_to_uint8(out.images)  # [1, C, H, W] -> uint8 [1, H, W, 3]: one frame
        finally:
            self.unstage()

    def close(self) -> None:
        super().close()
        self._parts.clear()
