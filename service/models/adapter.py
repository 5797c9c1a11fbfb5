"""Model families: what the runner needs to know about a diffusers pipeline directory.

An adapter declares, per family, which ``ModuleList``s of the transformer are streamed
(``block_attrs``), which modules stay fp32 when serving in bf16 (``keep_fp32``), the
size rules of a request, and how one request runs. Everything else (offload, MP4,
processes) is family-independent and lives in ``pipeline.py``/``local.py``.

The family comes from ``model_index.json``'s ``_class_name``, as diffusers does it (and,
where one pipeline class serves several families, from what the index holds: Wan2.2's
``transformer_2``, ``expand_timesteps``, an ``image_encoder``); components load through the
library classes that file names, never re-implemented. A family also says what it accepts
(``tasks``, ``image_input``), so a request it cannot serve is refused before any compute.
"""

from __future__ import annotations

import importlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from .meta import empty_weights
from .request import GenerationRequest, RequestError

if TYPE_CHECKING:  # a family is read (its card, a request's checks) without torch: the front end's case
    import numpy as np
    import torch
    from torch import nn

StepCallback = Callable[[int, int], None]
# (step done, total, latents after it, the loop's state after it: models/loop.py)
LatentsCallback = Callable[[int, int, "torch.Tensor", dict[str, Any]], None]
ALLOWED_LIBRARIES = ("diffusers", "transformers")



class ModelError(ValueError):
    """A model directory cannot be served; the message names the path."""


class NonFiniteOutput(ArithmeticError):
    """The decoded frames hold NaN or Inf: the request fails with this reason instead of
    storing a black video marked completed (the rank and its group are fine)."""


class ModelAdapter(ABC):
    """One model family. Subclasses fill the class variables and the abstract methods."""

    family: ClassVar[str]
    pipeline_classes: ClassVar[tuple[str, ...]]
    block_attrs: ClassVar[tuple[str, ...]]
    components: ClassVar[tuple[str, ...]]  # folders that must exist next to model_index.json
    extra_args: ClassVar[frozenset[str]] = frozenset()
    sequence_parallel: int = 1  # ranks one request's tokens are split across (SP group size)
    # (step, total, latents) at each step's end, before on_step: the rank's preview (engine.preview)
    latents_hook: Callable[[int, int, Any], None] | None = None
    # text encoders whose block lists can stream (components option "text_encoder")
    text_encoder_blocks: ClassVar[dict[str, tuple[str, ...]]] = {}
    can_probe: ClassVar[bool] = False  # has probe_inputs (--dlo-mode auto, a memory budget on CUDA)
    tasks: ClassVar[tuple[str, ...]] = ("t2v",)  # "t2v", "i2v", "t2i": what /v1/models reports
    image_input: ClassVar[str] = "none"  # "none", "optional" (TI2V) or "required" (I2V)
    experts: ClassVar[tuple[str, ...]] = ("transformer",)  # denoiser folders (Wan2.2 A14B: two)
    # Whether the family's pipeline runs CFG as a cond/uncond pair of calls that models.cfg can
    # batch (Wan); the server's rule for which requests do (PipelineRunner sets it; None: none).
    cfg_batchable: ClassVar[bool] = False
    cfg_rule: Callable[[GenerationRequest], bool] | None = None
    # Whether ``run`` takes ``on_frames`` and hands it the decoded frames chunk by chunk (Wan,
    # models/decode.py); other families' frames go to it whole (PipelineRunner.frames).
    streams_frames: ClassVar[bool] = False

    @classmethod
    def accepts(cls, index: dict[str, Any]) -> bool:
        """Whether this family serves a pipeline whose class is one of ``pipeline_classes``."""
        return True

    def __init__(self, model_dir: Path, index: dict[str, Any]) -> None:
        self.model_dir = model_dir
        self.index = index
        self.streamed: dict[str, Any] = {}  # component -> LayerwiseOffload handle
        self.staged: dict[str, Any] = {}  # component -> StagedModule
        for name in self.components:
            folder = model_dir / name
            if not folder.is_dir():
                raise ModelError(f"{folder}: component folder {name!r} is missing from {model_dir}")
            if not isinstance(index.get(name), list) or None in index[name]:
                raise ModelError(f"{model_dir / 'model_index.json'}: no class named for {name!r}")

    # -- what the offload runtime needs --------------------------------------------------

    @property
    def keep_fp32(self) -> tuple[str, ...]:
        """Module names that stay fp32 when the transformer is served in a lower dtype.

        The library class's own ``_keep_in_fp32_modules``, as its from_pretrained does.
        """
        return tuple(getattr(self.component_class("transformer"), "_keep_in_fp32_modules", None) or ())

    def build_transformer(self, only: str | None = None) -> nn.Module:
        """The denoiser on the meta device with real buffers (weights come from the runtime);
        with two experts an ``Experts`` module holding both (``only``: that one alone)."""
        from .experts import Experts

        def build(name: str) -> nn.Module:
            cls = self.component_class(name)
            config = cls.load_config(self.model_dir / name)
            # init_empty_weights keeps buffers real (rope tables are not in the checkpoint).
            with empty_weights():
                return cls.from_config(config).eval()

        if only is not None or len(self.experts) == 1:
            return build(only or self.experts[0])
        return Experts({name: build(name) for name in self.experts})

    def transformer_checkpoint(self, only: str | None = None) -> Path | dict[str, Path]:
        """The denoiser's safetensors (the sharded index's folder, or the single file); with
        two experts a key prefix -> checkpoint mapping (``only``: that one's alone)."""
        if only is None and len(self.experts) > 1:
            return {f"{name}.": self._checkpoint(name) for name in self.experts}
        return self._checkpoint(only or self.experts[0])

    def stored_quantization(self) -> str | None:
        """"fp8" when ``dloserve quantize`` wrote the denoiser's files (their headers say so),
        else None: what ``--quantization auto`` serves."""
        from service.offload.files import stored_format

        ckpt = self.transformer_checkpoint()
        paths = ckpt.values() if isinstance(ckpt, dict) else (ckpt,)
        return "fp8" if any(stored_format(p) for p in paths) else None

    @property
    def offload_block_attrs(self) -> tuple[str, ...]:
        """The block lists as the offload sees them (prefixed by the expert with two)."""
        if len(self.experts) == 1:
            return self.block_attrs
        return tuple(f"{e}.{a}" for e in self.experts for a in self.block_attrs)

    def expert_plan(self, req: GenerationRequest) -> tuple[int, ...]:
        """The expert of each of ``req``'s transformer forwards (all 0 with one expert)."""
        return (0,) * self.forwards(req)

    def card(self) -> dict[str, Any]:
        """What this model does, for /v1/models and /readyz."""
        return {"family": self.family, "pipeline": self.index.get("_class_name"), "tasks": list(self.tasks),
                "image_input": self.image_input, "experts": list(self.experts)}

    def _checkpoint(self, name: str) -> Path:
        folder = self.model_dir / name
        if any(folder.glob("*.safetensors.index.json")):
            return folder
        single = folder / "diffusion_pytorch_model.safetensors"
        if single.is_file():
            return single
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ModelError(f"{folder}: no safetensors weights for the transformer")
        return folder  # one oddly named file (the checkpoint loader errors on several)

    def set_sequence_parallel(self, degree: int) -> None:
        """Serve each request across ``degree`` ranks; ModelError if this family cannot."""
        if degree != 1:
            raise ModelError(f"--sequence-parallel-size {degree}: not supported for {self.family} "
                             "(only Wan T2V has sequence parallelism)")

    # -- requests --------------------------------------------------------------------------

    def validate(self, req: GenerationRequest) -> None:
        """Family rules on top of ``req.check()``; raises RequestError naming the field."""
        req.check()
        if req.image is None and self.image_input == "required":
            raise RequestError("image", f"{self.family} is image-to-video: an image is required")
        if req.image is not None and self.image_input == "none":
            raise RequestError("image", f"{self.family} takes no image ({'/'.join(self.tasks)} only)")
        unknown = sorted(set(req.extra) - self.extra_args)
        if unknown:
            allowed = sorted(self.extra_args) or "none"
            raise RequestError(
                "extra", f"unknown argument(s) {unknown} for {self.family} (allowed: {allowed})"
            )

    def cfg_batched(self, req: GenerationRequest) -> bool:
        """Whether ``req``'s CFG rows run in one forward (a function of the request and the
        server's settings only, so every strategy and rank counts the same forwards)."""
        return req.cfg and self.cfg_batchable and self.cfg_rule is not None and self.cfg_rule(req)

    def forwards(self, req: GenerationRequest) -> int:
        """Transformer forwards ``req`` makes (those of its steps left, when resumed): what an
        idle rank replays.

        Wan runs the transformer twice per step under CFG (``req.forwards()``), once when the
        two rows are batched (``cfg_batched``); a family with distilled guidance (Flux-dev)
        runs it once and overrides this.
        """
        return req.num_inference_steps - req.start_step if self.cfg_batched(req) else req.forwards()

    def resume_blocker(self, req: GenerationRequest) -> str:
        """Why a rerun of ``req`` cannot go on from a saved step ("" when it can:
        models/resume.py); a family that can hands its state to ``run``'s ``on_latents``."""
        return f"{self.family} does not keep its step state"

    def latent_spec(self, req: GenerationRequest) -> tuple[tuple[int, ...], str] | None:
        """(shape, dtype) of the latents a resumable family hands ``on_latents`` for ``req``: what
        a state read back from storage must match (None: no state of this family is used)."""
        return None

    @abstractmethod
    def load_components(self, device: torch.device, components: tuple[str, ...] = ("dit",)) -> None:
        """Load everything but the transformer: resident on ``device``, or streamed/staged
        where ``components`` says so (see ``load_part``)."""

    def load_part(self, name: str, device: torch.device, components: tuple[str, ...]) -> Any:
        """One model component: streamed (a text encoder), staged (the VAE) or resident."""
        from .components import load_streamed_text_encoder

        if name in self.text_encoder_blocks and "text_encoder" in components:
            module, handle = load_streamed_text_encoder(
                self.component_class(name), self.model_dir / name, device, self.text_encoder_blocks[name])
            self.streamed[name] = handle
            return module
        if name == "vae" and "vae" in components:
            from service.offload.staged import StagedModule

            vae = self.load_component(name).eval()
            self.staged[name] = StagedModule(vae, device)
            return vae
        return self.load_component(name, device)

    def step_callback(self, on_step: StepCallback | None, steps: int) -> StepCallback:
        """``on_step`` plus staging: staged modules go to the device after the last step."""

        def callback(done: int, total: int, latents: Any = None) -> None:
            if latents is not None and self.latents_hook is not None:
                self.latents_hook(done, total, latents)  # the preview (engine.preview), before the event
            if done == steps:
                for s in self.staged.values():
                    s.stage_in()
            if on_step is not None:
                on_step(done, total)

        return callback

    def unstage(self) -> None:
        """After a request (also one that failed): staged modules back to host memory."""
        for s in self.staged.values():
            s.stage_out()

    def component_stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {n: h.stats(sync=False).as_dict() for n, h in self.streamed.items()}
        out.update({n: {"staged_bytes": s.nbytes} for n, s in self.staged.items()})
        return out

    def probe_inputs(self, transformer: nn.Module, height: int, width: int, frames: int,
                     device: torch.device, batch: int = 1) -> dict[str, Any]:
        """Keyword inputs of one transformer forward at this size (``batch`` rows: 2 for a
        CFG-batched server), for the load-time probe."""
        raise NotImplementedError(f"{self.family}: no probe inputs (--dlo-mode auto and "
                                  "--dlo-device-memory-gb on CUDA need them)")

    @abstractmethod
    def run(
        self, transformer: nn.Module, req: GenerationRequest, on_step: StepCallback | None,
        on_latents: LatentsCallback | None = None,
    ) -> np.ndarray:
        """Run one request end to end; uint8 frames [T, H, W, 3]. ``on_latents``: after each
        step but the last, its latents and loop state (a resumable family only)."""

    def close(self) -> None:
        """Drop the components (and free what their offload handles hold)."""
        for h in self.streamed.values():
            h.close()
        self.streamed.clear()
        self.staged.clear()

    # -- helpers -----------------------------------------------------------------------

    def component_class(self, name: str) -> type:
        """The library class ``model_index.json`` names for a component (as diffusers loads it)."""
        lib, cls = self.index[name]
        if lib not in ALLOWED_LIBRARIES:
            raise ModelError(f"{self.model_dir / 'model_index.json'}: {name!r} comes from {lib!r}, "
                             f"only {ALLOWED_LIBRARIES} are loaded")
        try:
            return getattr(importlib.import_module(lib), cls)
        except AttributeError as e:
            raise ModelError(f"{self.model_dir / 'model_index.json'}: {lib} has no class {cls!r} "
                             f"(component {name!r})") from e

    def load_component(self, name: str, device: torch.device | None = None) -> Any:
        from torch import nn

        obj = self.component_class(name).from_pretrained(self.model_dir / name)
        if device is not None and isinstance(obj, nn.Module):
            obj = obj.to(device).eval()
        return obj


def frames_to_uint8(video: torch.Tensor) -> np.ndarray:
    """Frames [T, C, H, W] in [0, 1] on any device -> uint8 [T, H, W, 3] on the host.

    The same float32 arithmetic as ``video.to_uint8`` on diffusers' numpy output (clip,
    x255, round half to even), done where the frames are, so a 480p clip crosses to the
    host as 97 MB of uint8 instead of 388 MB of float32. NonFiniteOutput when a frame holds
    NaN or Inf (one pass over the frames where they are: clamp would make NaN black).
    """
    import torch

    if not bool(torch.isfinite(video).all()):
        raise NonFiniteOutput("the decoded frames hold NaN or Inf (an adapter or settings that overflow "
                              "the model's numbers): no video was stored")
    x = (video.float().clamp(0.0, 1.0) * 255.0).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).contiguous().cpu().numpy()


def read_index(model_dir: str | Path) -> tuple[Path, dict[str, Any]]:
    path = Path(model_dir)
    index_file = path / "model_index.json"
    if not path.is_dir():
        raise ModelError(f"{path}: model directory does not exist")
    if not index_file.is_file():
        raise ModelError(f"{index_file}: missing; not a diffusers pipeline directory")
    try:
        index = json.loads(index_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"{index_file}: cannot read: {e}") from e
    if not isinstance(index, dict) or "_class_name" not in index:
        raise ModelError(f"{index_file}: no _class_name")
    return path, index
