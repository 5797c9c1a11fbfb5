"""One generation request, its model-independent checks, and its compatibility key.

The compatibility key is what the router groups waves by: requests in one DP wave must
make the same sequence of collective calls (same number of transformer forwards) and,
for balance, the same shapes. Prompt and seed change neither, so they stay out of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from service.config.cache import CacheError, CacheSpec
from service.config.errors import FieldError

from .lora_ref import LoraRef, lora_problem

if TYPE_CHECKING:
    from .resume import StepState

MAX_SIDE = 4096
MAX_FRAMES = 1025
MAX_STEPS = 1000
MAX_PROMPT_CHARS = 10_000
PRIORITY_RANGE = (-100, 100)  # vLLM's convention: lower is served first, 0 the default
# ``extra`` values that only scale the guidance after the forwards: not in the compatibility key
VALUE_ONLY_EXTRA = frozenset({"guidance_scale_2"})


class RequestError(FieldError):
    """A request field is invalid; ``field`` names it (for HTTP 422 bodies and CLI errors)."""


@dataclass(frozen=True)
class GenerationRequest:
    """A text-to-video (or image-to-video) request. Defaults are the tiny demo model's
    CI-sized request.

    ``flow_shift`` overrides the checkpoint scheduler's shift (Wan: 3.0 at 480p, 5.0 at
    720p); ``extra`` carries family-specific pipeline arguments (Wan: ``max_sequence_length``;
    Wan2.2 A14B: ``guidance_scale_2``). ``image``: the conditioning image as its file's
    bytes (PNG, JPEG or WebP, checked by ``service.models.image.check_image``), decoded on
    the rank, so every front end that passes the same file gets the same video.
    ``cache``: the step cache (service/config/cache.py); None takes the server's ``--cache`` default.
    ``resume``: the state a rerun starts from (resume.py; set by the dispatcher, never by a
    caller): the request's steps before ``resume.step`` make no forward.
    ``priority``: when it runs, never what it makes (lower first; router/priority.py): not in
    the compatibility key, no effect on the bytes.
    """

    prompt: str
    negative_prompt: str = ""
    seed: int = 0
    height: int = 32
    width: int = 32
    num_frames: int = 5
    fps: int = 8
    num_inference_steps: int = 2
    guidance_scale: float = 5.0
    flow_shift: float | None = None
    extra: dict[str, Any] = field(default_factory=dict, hash=False)
    loras: tuple[LoraRef, ...] = ()
    image: bytes | None = field(default=None, repr=False)
    cache: CacheSpec | None = None
    resume: StepState | None = field(default=None, repr=False, compare=False, hash=False)
    priority: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.cache, dict | str):  # a batch line's object, a CLI spec
            try:
                object.__setattr__(self, "cache", CacheSpec.from_obj(self.cache))
            except CacheError as e:
                raise RequestError(e.field, e.message) from None

    @property
    def cfg(self) -> bool:
        """Classifier-free guidance on: the transformer runs twice per step (diffusers: > 1)."""
        return self.guidance_scale > 1.0

    @property
    def start_step(self) -> int:
        """The step this run starts from (0, or where a resumed rerun goes on)."""
        return self.resume.step if self.resume is not None else 0

    def forwards(self) -> int:
        """Transformer forwards this request makes (what an idle DP rank must replay): those
        of the steps it still has to run."""
        return (self.num_inference_steps - self.start_step) * (2 if self.cfg else 1)

    def resumed(self, state: StepState | None) -> GenerationRequest:
        """This request going on from ``state`` (None: from step 0)."""
        return replace(self, resume=state)

    def compat_key(self) -> str:
        """Canonical JSON of every field that changes collective calls, shapes or schedule.

        The guidance *value* only scales a difference after the forwards, so only CFG
        on/off is in the key: requests with guidance 4.0 and 6.0 can share a wave (and
        ``guidance_scale_2``'s value is left out the same way). An image changes no gather
        but does change the work before the first forward (the VAE encodes it, and CLIP
        for Wan2.1 I2V) and, for TI2V, the pipeline that runs: whether there is one is in.
        The step cache is not in it: every forward passes the same decision points whatever
        the cache, and a block is gathered when any rank needs it (docs/caches.md).
        """
        key = {
            "height": self.height,
            "width": self.width,
            "num_frames": self.num_frames,
            "fps": self.fps,
            "num_inference_steps": self.num_inference_steps,
            "cfg": self.cfg,
            "flow_shift": self.flow_shift,
            "num_outputs": 1,
            "lora": None,  # kept for stable keys: adapters are per rank, never per wave
            "image": self.image is not None,
            "extra": {k: v for k, v in self.extra.items() if k not in VALUE_ONLY_EXTRA},
        }
        return json.dumps(key, sort_keys=True, separators=(",", ":"), allow_nan=False)

    def check(self) -> None:
        """Model-independent checks; the adapter adds the model's size/frame rules."""
        _int_in("seed", self.seed, 0, 2**63 - 1)
        _int_in("height", self.height, 1, MAX_SIDE)
        _int_in("width", self.width, 1, MAX_SIDE)
        _int_in("num_frames", self.num_frames, 1, MAX_FRAMES)
        _int_in("fps", self.fps, 1, 240)
        _int_in("num_inference_steps", self.num_inference_steps, 1, MAX_STEPS)
        _int_in("priority", self.priority, *PRIORITY_RANGE)
        for name in ("prompt", "negative_prompt"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise RequestError(name, f"must be a string, got {type(value).__name__}")
            if len(value) > MAX_PROMPT_CHARS:
                raise RequestError(name, f"is {len(value)} characters, at most {MAX_PROMPT_CHARS}")
        if not self.prompt.strip():
            raise RequestError("prompt", "must not be empty")
        _float_in("guidance_scale", self.guidance_scale, 0.0, 100.0)
        if self.flow_shift is not None:
            _float_in("flow_shift", self.flow_shift, 1e-3, 100.0)
        if self.image is not None and not isinstance(self.image, bytes):
            raise RequestError("image", f"must be the image file's bytes, got {type(self.image).__name__}")
        problem = lora_problem(self.loras)
        if problem:
            raise RequestError(*problem)
        if self.cache is not None:
            if not isinstance(self.cache, CacheSpec):
                raise RequestError("cache", f"must be a cache object, got {type(self.cache).__name__}")
            try:
                self.cache.check()
            except CacheError as e:
                raise RequestError(e.field, e.message) from None
        st = self.resume
        if st is not None and not 0 < st.step < st.total == self.num_inference_steps:
            raise RequestError("resume", f"step {self.resume.step} of {self.resume.total} is not a step "
                                         f"to go on from for {self.num_inference_steps} steps")
        if not isinstance(self.extra, dict):
            raise RequestError("extra", "must be an object")
        try:
            json.dumps(self.extra, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise RequestError("extra", f"must be plain JSON: {e}") from e


def _int_in(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(name, f"must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise RequestError(name, f"must be in [{lo}, {hi}], got {value}")


def _float_in(name: str, value: object, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(name, f"must be a number, got {value!r}")
    if not lo <= float(value) <= hi:  # also rejects NaN
        raise RequestError(name, f"must be in [{lo}, {hi}], got {value}")
