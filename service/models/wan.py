"""Wan2.1 text-to-video: diffusers' own ``WanPipeline`` with our transformer plugged in.

We drive the library pipeline rather than copy its loop, so prompt cleaning, text
padding, CFG, the scheduler step and latent de-normalisation are exactly diffusers'
(the reference test compares against ``WanPipeline.from_pretrained``). Only the
transformer differs: it is the meta-built module whose blocks the offload runtime feeds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .adapter import ModelAdapter, ModelError, StepCallback, frames_to_uint8
from .request import GenerationRequest, RequestError
from .sequence import SequenceParallelError, check_heads, split_hint

DEFAULT_MAX_SEQUENCE_LENGTH = 512  # WanPipeline's default: part of the key via ``extra``


class WanAdapter(ModelAdapter):
    """Wan2.1 T2V (1.3B, 14B, and the demo presets)."""

    family = "wan-t2v"
    pipeline_classes = ("WanPipeline",)
    block_attrs = ("blocks",)
    components = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
    extra_args = frozenset({"max_sequence_length"})
    text_encoder_blocks = {"text_encoder": ("encoder.block",)}  # UMT5
    can_probe = True

    def __init__(self, model_dir: Path, index: dict[str, Any]) -> None:
        super().__init__(model_dir, index)
        if index.get("boundary_ratio") is not None or (index.get("transformer_2") or [None])[0]:
            raise ModelError(f"{model_dir}: two-stage Wan2.2 (transformer_2) is not supported yet")
        self.transformer_config = _read_json(model_dir / "transformer" / "config.json")
        vae_config = _read_json(model_dir / "vae" / "config.json")
        patch = self.transformer_config.get("patch_size", [1, 2, 2])
        spatial = int(vae_config.get("scale_factor_spatial", 8))
        self.temporal = int(vae_config.get("scale_factor_temporal", 4)) * int(patch[0])
        self.multiple = (spatial * int(patch[1]), spatial * int(patch[2]))
        sched = model_dir / "scheduler" / "scheduler_config.json"
        self.scheduler_config = _read_json(sched) if sched.is_file() else {}
        self._parts: dict[str, Any] = {}

    def set_sequence_parallel(self, degree: int) -> None:
        try:
            check_heads(int(self.transformer_config.get("num_attention_heads", 40)), degree)
        except SequenceParallelError as e:
            raise ModelError(f"{self.model_dir}: {e}") from None
        self.sequence_parallel = degree

    def tokens(self, req: GenerationRequest) -> tuple[int, int, int]:
        """(latent frames, patch rows, patch cols): the transformer's token grid for ``req``."""
        mh, mw = self.multiple
        return (req.num_frames - 1) // self.temporal + 1, req.height // mh, req.width // mw

    def validate(self, req: GenerationRequest) -> None:
        super().validate(req)
        mh, mw = self.multiple
        if req.height % mh:
            raise RequestError("height", f"must be a multiple of {mh} (VAE x patch), got {req.height}")
        if req.width % mw:
            raise RequestError("width", f"must be a multiple of {mw} (VAE x patch), got {req.width}")
        if (req.num_frames - 1) % self.temporal:
            raise RequestError(
                "num_frames", f"must be {self.temporal}k+1 (1, 5, 9, ..., 81), got {req.num_frames}"
            )
        if req.flow_shift is not None and not {"flow_shift", "shift"} & set(self.scheduler_config):
            name = self.scheduler_config.get("_class_name", "the scheduler")
            raise RequestError("flow_shift", f"{name} has no flow shift setting")
        msl = req.extra.get("max_sequence_length", DEFAULT_MAX_SEQUENCE_LENGTH)
        if isinstance(msl, bool) or not isinstance(msl, int) or not 1 <= msl <= 512:
            raise RequestError("extra.max_sequence_length", f"must be an integer in [1, 512], got {msl!r}")
        if self.sequence_parallel > 1:  # after the size rules: the grid is whole by now
            why = split_hint(self.tokens(req), self.sequence_parallel)
            if why:
                raise RequestError("num_frames", why)

    def load_components(self, device: torch.device, components: tuple[str, ...] = ("dit",)) -> None:
        self._parts = {
            "tokenizer": self.load_component("tokenizer"),
            "text_encoder": self.load_part("text_encoder", device, components),
            "vae": self.load_part("vae", device, components),
            "scheduler": self.load_component("scheduler"),
        }

    def probe_inputs(self, transformer: nn.Module, height: int, width: int, frames: int,
                     device: torch.device) -> dict[str, Any]:
        """Transformer inputs of one forward at this size (random: only the shapes matter)."""
        cfg = self.transformer_config
        dtype = transformer.patch_embedding.weight.dtype
        spatial = self.multiple[0] // int(cfg.get("patch_size", [1, 2, 2])[1])
        g = torch.Generator().manual_seed(0)
        lat = (1, int(cfg.get("in_channels", 16)), (frames - 1) // self.temporal + 1,
               height // spatial, width // spatial)
        text = (1, DEFAULT_MAX_SEQUENCE_LENGTH, int(cfg.get("text_dim", 4096)))
        return {
            "hidden_states": torch.randn(lat, generator=g).to(device, dtype),
            "timestep": torch.tensor([500], device=device),
            "encoder_hidden_states": torch.randn(text, generator=g).to(device, dtype),
            "return_dict": False,
        }

    def _scheduler(self, req: GenerationRequest) -> Any:
        """A fresh scheduler per request (they are stateful), with the request's shift."""
        base = self._parts["scheduler"]
        overrides = {}
        if req.flow_shift is not None:
            if "flow_shift" not in base.config and "shift" not in base.config:
                raise RequestError("flow_shift", f"{type(base).__name__} has no flow shift setting")
            overrides["flow_shift" if "flow_shift" in base.config else "shift"] = req.flow_shift
        return type(base).from_config(base.config, **overrides)

    def run(
        self, transformer: nn.Module, req: GenerationRequest, on_step: StepCallback | None
    ) -> np.ndarray:
        from diffusers import WanPipeline

        if not self._parts:
            raise RuntimeError("load_components() was not called")
        pipe = WanPipeline(transformer=transformer, scheduler=self._scheduler(req), **{
            k: v for k, v in self._parts.items() if k != "scheduler"
        })
        pipe.set_progress_bar_config(disable=True)
        steps = req.num_inference_steps
        step = self.step_callback(on_step, steps)

        def callback(_pipe: Any, i: int, _t: Any, _kwargs: dict) -> dict:
            step(i + 1, steps)
            return {}

        # Latents from a CPU generator: the same numbers on every rank and device.
        generator = torch.Generator("cpu").manual_seed(req.seed)
        try:
            out = pipe(
                prompt=req.prompt,
                negative_prompt=req.negative_prompt,
                height=req.height,
                width=req.width,
                num_frames=req.num_frames,
                num_inference_steps=steps,
                guidance_scale=req.guidance_scale,
                generator=generator,
                output_type="pt",  # stays on the device: uint8 there, 4x fewer bytes to copy
                callback_on_step_end=callback,
                max_sequence_length=req.extra.get("max_sequence_length", DEFAULT_MAX_SEQUENCE_LENGTH),
            )
            return frames_to_uint8(out.frames[0])  # [T, C, H, W] -> uint8 [T, H, W, 3]
        finally:
            self.unstage()

    def close(self) -> None:
        super().close()
        self._parts.clear()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: cannot read config: {e}") from e
