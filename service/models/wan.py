"""Wan2.1 text-to-video, and what every Wan family shares: diffusers' own pipelines, our transformer.

We drive the library pipeline rather than copy its loop, so prompt cleaning, text
padding, CFG, the scheduler step, the expert switch of Wan2.2, image conditioning and
latent de-normalisation are exactly diffusers' (the reference tests compare against
``WanPipeline`` / ``WanImageToVideoPipeline.from_pretrained``). Only the transformer(s)
differ: the meta-built modules whose blocks the offload runtime feeds.

The other Wan families (``wan_i2v.py``, ``wan22.py``) are this class with other class
variables: which pipeline class takes a text request and which an image one, the
denoiser folders (one, or Wan2.2 A14B's two experts), the extra components (CLIP for
Wan2.1 I2V) and what the family accepts.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from .adapter import LatentsCallback, ModelAdapter, ModelError, StepCallback, frames_to_uint8
from .request import GenerationRequest, RequestError
from .sequence import SequenceParallelError, check_heads, split_hint

if TYPE_CHECKING:  # the run's modules load with it: the front end reads the card and checks requests only
    import numpy as np
    import torch
    from torch import nn

    from .decode import FramesCallback

DEFAULT_MAX_SEQUENCE_LENGTH = 512  # WanPipeline's default: part of the key via ``extra``
CLIP_TOKENS = 257  # CLIP ViT-H/14 at 224 px: 256 patches + the class token (Wan2.1 I2V's image context)


def two_experts(index: dict[str, Any]) -> bool:
    """Whether a Wan model index is a two-stage Wan2.2 A14B (``transformer_2``, ``boundary_ratio``)."""
    return index.get("boundary_ratio") is not None or bool((index.get("transformer_2") or [None])[0])


def named(index: dict[str, Any], component: str) -> bool:
    """Whether the index names a class for ``component`` (diffusers writes [null, null] for none)."""
    return bool((index.get(component) or [None, None])[-1])


class WanAdapter(ModelAdapter):
    """Wan2.1 T2V (1.3B, 14B, and the demo presets); the base of every Wan family."""

    family = "wan-t2v"
    pipeline_classes = ("WanPipeline",)
    block_attrs = ("blocks",)
    components = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
    extra_args = frozenset({"max_sequence_length"})
    text_encoder_blocks = {"text_encoder": ("encoder.block",)}  # UMT5
    can_probe = True
    cfg_batchable = True
    tasks = ("t2v",)
    streams_frames = True  # run() takes on_frames: the VAE's chunks as they are decoded
    text_pipeline: ClassVar[str | None] = "WanPipeline"  # runs a request without an image
    image_pipeline: ClassVar[str | None] = None  # runs a request with one

    @classmethod
    def accepts(cls, index: dict[str, Any]) -> bool:
        return not two_experts(index) and not index.get("expand_timesteps")

    def __init__(self, model_dir: Path, index: dict[str, Any]) -> None:
        super().__init__(model_dir, index)
        if len(self.experts) == 1 and two_experts(index):
            raise ModelError(f"{model_dir}: a two-expert Wan2.2 model (transformer_2) given to {self.family}")
        self.transformer_config = _read_json(model_dir / "transformer" / "config.json")
        vae_config = _read_json(model_dir / "vae" / "config.json")
        patch = self.transformer_config.get("patch_size", [1, 2, 2])
        spatial = int(vae_config.get("scale_factor_spatial", 8))
        self.temporal = int(vae_config.get("scale_factor_temporal", 4)) * int(patch[0])
        self.multiple = (spatial * int(patch[1]), spatial * int(patch[2]))
        self.latent_scale = (int(vae_config.get("scale_factor_temporal", 4)), spatial)
        self.latent_channels = int(vae_config.get("z_dim", self.transformer_config.get("in_channels", 16)))
        sched = model_dir / "scheduler" / "scheduler_config.json"
        self.scheduler_config = _read_json(sched) if sched.is_file() else {}
        self.boundary_ratio = index.get("boundary_ratio")
        self._parts: dict[str, Any] = {}
        self._base_scheduler: Any = None
        self._blocker: str | None = None  # why the scheduler's state cannot be kept ("": it can)

    def set_sequence_parallel(self, degree: int) -> None:
        if len(self.experts) > 1 or self.family != "wan-t2v":
            super().set_sequence_parallel(degree)
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
        g2 = req.extra.get("guidance_scale_2")
        if g2 is not None and (isinstance(g2, bool) or not isinstance(g2, int | float) or not 0 <= g2 <= 100):
            raise RequestError("extra.guidance_scale_2", f"must be a number in [0, 100], got {g2!r}")
        if req.loras and len(self.experts) > 1:  # the side branches hook one transformer today
            raise RequestError("loras", f"{self.family}: LoRA adapters on a two-expert model are not "
                                        "supported yet (one-transformer Wan models only)")
        if self.sequence_parallel > 1:  # after the size rules: the grid is whole by now
            why = split_hint(self.tokens(req), self.sequence_parallel)
            if why:
                raise RequestError("num_frames", why)

    def expert_plan(self, req: GenerationRequest) -> tuple[int, ...]:
        from .experts import expert_plan

        if len(self.experts) == 1:
            return super().expert_plan(req)
        per_step = 2 if req.cfg and not self.cfg_batched(req) else 1
        plan = expert_plan(self._scheduler(req), req.num_inference_steps, self.boundary_ratio, per_step == 2)
        return plan[req.start_step * per_step:]  # a resumed run makes the forwards of its steps left

    def resume_blocker(self, req: GenerationRequest) -> str:
        """No SP (each rank runs the loop on its share), and a scheduler whose state can be kept."""
        if self.sequence_parallel > 1:
            return "sequence parallel runs are not resumed yet"
        if self._blocker is None:
            from .loop import scheduler_blocker

            self._blocker = scheduler_blocker(self._scheduler(req))
        return self._blocker

    def latent_spec(self, req: GenerationRequest) -> tuple[tuple[int, ...], str]:
        """The denoising latents of ``req``: one video, the VAE's channels, its temporal and
        spatial scale; float32, as diffusers' Wan pipelines make them."""
        temporal, spatial = self.latent_scale
        return ((1, self.latent_channels, (req.num_frames - 1) // temporal + 1, req.height // spatial,
                 req.width // spatial), "float32")

    def load_components(self, device: torch.device, components: tuple[str, ...] = ("dit",)) -> None:
        self._parts = {
            "tokenizer": self.load_component("tokenizer"),
            "text_encoder": self.load_part("text_encoder", device, components),
            "vae": self.load_part("vae", device, components),
            "scheduler": self.load_component("scheduler"),
        }
        for name in ("image_encoder", "image_processor"):  # Wan2.1 I2V's CLIP (resident)
            if name in self.components:
                self._parts[name] = self.load_component(name, device)

    def probe_inputs(self, transformer: nn.Module, height: int, width: int, frames: int,
                     device: torch.device, batch: int = 1) -> dict[str, Any]:
        """Transformer inputs of one forward at this size (random: only the shapes matter);
        ``batch`` 2: a CFG-batched forward."""
        import torch

        cfg = self.transformer_config
        dtype = transformer.patch_embedding.weight.dtype
        spatial = self.multiple[0] // int(cfg.get("patch_size", [1, 2, 2])[1])
        g = torch.Generator().manual_seed(0)
        lat = (batch, int(cfg.get("in_channels", 16)), (frames - 1) // self.temporal + 1,
               height // spatial, width // spatial)
        text = (batch, DEFAULT_MAX_SEQUENCE_LENGTH, int(cfg.get("text_dim", 4096)))
        inputs = {
            "hidden_states": torch.randn(lat, generator=g).to(device, dtype),
            "timestep": torch.tensor([500] * batch, device=device),
            "encoder_hidden_states": torch.randn(text, generator=g).to(device, dtype),
            "return_dict": False,
        }
        if cfg.get("image_dim"):  # Wan2.1 I2V: the CLIP image context too
            image = (batch, CLIP_TOKENS, int(cfg["image_dim"]))
            inputs["encoder_hidden_states_image"] = torch.randn(image, generator=g).to(device, dtype)
        return inputs

    def _scheduler(self, req: GenerationRequest) -> Any:
        """A fresh scheduler per request (they are stateful), with the request's shift."""
        base = self._parts.get("scheduler")
        if base is None:  # an expert plan before load_components (the scheduler config alone)
            if self._base_scheduler is None:
                self._base_scheduler = self.load_component("scheduler")
            base = self._base_scheduler
        overrides = {}
        if req.flow_shift is not None:
            if "flow_shift" not in base.config and "shift" not in base.config:
                raise RequestError("flow_shift", f"{type(base).__name__} has no flow shift setting")
            overrides["flow_shift" if "flow_shift" in base.config else "shift"] = req.flow_shift
        return type(base).from_config(base.config, **overrides)

    def _pipeline(self, transformer: nn.Module, req: GenerationRequest,
                  wrap: Callable[[nn.Module], Any] | None = None) -> Any:
        """The diffusers pipeline object for ``req``: our denoiser(s) (each through ``wrap``
        if given), the loaded parts and the index's own settings (``boundary_ratio``,
        ``expand_timesteps``)."""
        import diffusers

        from .experts import expert_of

        name = self.image_pipeline if req.image is not None else self.text_pipeline
        assert name is not None  # validate() refused the request otherwise
        denoisers = {k: wrap(m) if wrap else m
                     for k, m in zip(self.experts, expert_of(transformer), strict=True)}
        parts = {k: v for k, v in self._parts.items() if k != "scheduler"}
        config = {k: self.index[k] for k in ("boundary_ratio", "expand_timesteps") if self.index.get(k)}
        pipe = getattr(diffusers, name)(scheduler=self._scheduler(req), **denoisers, **parts, **config)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def run(
        self, transformer: nn.Module, req: GenerationRequest, on_step: StepCallback | None,
        on_latents: LatentsCallback | None = None, on_frames: FramesCallback | None = None,
    ) -> np.ndarray | None:
        import torch

        from . import cfg, loop
        from .decode import decode_frames
        from .experts import expert_of
        from .rerun import Resumed

        if not self._parts:
            raise RuntimeError("load_components() was not called")
        pipe = self._pipeline(transformer, req)
        steps = req.num_inference_steps
        step = self.step_callback(on_step, steps)
        msl = req.extra.get("max_sequence_length", DEFAULT_MAX_SEQUENCE_LENGTH)
        extra: dict[str, Any] = {"prompt": req.prompt, "negative_prompt": req.negative_prompt}
        if self.cfg_batched(req):  # both prompts encoded first: the batcher needs the negative one
            denoiser = expert_of(transformer)[0]
            cond, negative = cfg.encode(pipe, req.prompt, req.negative_prompt, msl, pipe._execution_device,
                                        denoiser.dtype)
            pipe = self._pipeline(transformer, req, lambda m: cfg.CfgBatched(m, negative))
            extra = {"prompt_embeds": cond, "negative_prompt_embeds": negative}
        generator = torch.Generator("cpu").manual_seed(req.seed)  # the same numbers on every rank and device
        resumed: list[Resumed] = []
        if req.resume is not None:  # a rerun: no forward before its step, then its state back
            device = pipe._execution_device  # as the pipeline will see it (before the swap)
            for name in ("transformer", "transformer_2"):  # (around the CFG batcher, if any)
                if getattr(pipe, name, None) is not None:
                    resumed.append(Resumed(getattr(pipe, name), req.resume, device))
                    object.__setattr__(pipe, name, resumed[-1])  # not the config: the stand-in is ours
            saved = req.resume.loop_tree(device)
            if saved is None:
                raise RequestError("resume", "the saved step holds no loop state (models/resume.py)")
        denoisers = expert_of(transformer)

        def callback(pipe_: Any, i: int, _t: Any, kwargs: dict) -> dict:
            out: dict[str, Any] = {}
            for r in resumed:
                r.done = i + 1
            if req.resume is not None and i + 1 == req.start_step:
                loop.put(saved, pipe_.scheduler, denoisers, generator)
                out["latents"] = req.resume.tensor(kwargs["latents"].device)
            latents = out.get("latents", kwargs["latents"])
            if on_latents is not None and req.start_step < i + 1 < steps:
                on_latents(i + 1, steps, latents, loop.take(pipe_.scheduler, denoisers, generator))
            step(i + 1, steps, latents if i + 1 >= req.start_step else None)
            return out

        if req.image is not None:
            from .image import decode_image

            extra["image"] = decode_image(req.image)
        if req.extra.get("guidance_scale_2") is not None:
            extra["guidance_scale_2"] = float(req.extra["guidance_scale_2"])
        try:
            out = pipe(
                height=req.height,
                width=req.width,
                num_frames=req.num_frames,
                num_inference_steps=steps,
                guidance_scale=req.guidance_scale,
                generator=generator,
                # stays on the device: uint8 there, 4x fewer bytes to copy; with on_frames, the
                # latents, decoded here chunk by chunk (models/decode.py)
                output_type="latent" if on_frames is not None else "pt",
                callback_on_step_end=callback,
                max_sequence_length=msl,
                **extra,
            )
            if on_frames is not None:
                decode_frames(pipe, out.frames, on_frames)
                return None
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
