"""HTTP shapes: the create body (JSON or multipart, as the openai client sends it) and
the OpenAI-style video object. Conversion to a GenerationRequest happens here so every
field error can be reported by its HTTP name.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator

from service.api.errors import Answer, ApiError, BodyError
from service.config.cache import MAX_RATIOS, METHODS, PARAMS, CacheError, CacheSpec
from service.models.lora_ref import MAX_LORAS, LoraRef
from service.models.request import PRIORITY_RANGE, GenerationRequest

MAX_SECONDS = 600  # far past any frame limit; bounds seconds x fps before it is rounded
SIZE_PATTERN = r"^[1-9][0-9]{0,4}x[1-9][0-9]{0,4}$"  # ASCII digits only: no "X", spaces or other scripts
SECONDS_PATTERN = r"^[0-9]{1,4}(\.[0-9]{1,6})?$"  # OpenAI sends seconds as a string ("4")
NESTED_OBJECTS = frozenset({"cache"})  # object fields whose errors name the inner field: cache.threshold
NUMERIC_FIELDS = frozenset({"width", "height", "seconds", "num_frames", "fps", "seed", "num_inference_steps",
                            "guidance_scale", "flow_shift", "max_sequence_length", "guidance_scale_2",
                            "priority"})
# A form's number, as JSON writes one: no "4_0" (Python's int() reads 40), "+4", " 4", "0x10".
FORM_NUMBER = re.compile(r"-?[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?")


class LoraUse(BaseModel):
    """One adapter a request applies (registered under ``name``: GET /v1/loras)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    scale: float = Field(1.0, description="multiplies the adapter's lora_alpha / r (diffusers' set_adapters)")
    expert: Literal["both", "high", "low"] | None = None


class CacheUse(BaseModel):
    """A request's step cache (docs/caches.md): CacheSpec's fields as the body has them; parameters
    left out take the method's defaults (``PARAMS``, written once in service/config/cache.py)."""

    model_config = ConfigDict(extra="forbid")

    method: Literal[METHODS]  # type: ignore[valid-type]
    threshold: float | None = Field(None, description="first_block: relative change of block 0's residual "
                                    f"(default {PARAMS['first_block']['threshold']}); mag: accumulated error "
                                    f"(default {PARAMS['mag']['threshold']})")
    max_skip_steps: int | None = Field(None, description="mag: at most this many skipped steps in a row "
                                       f"({PARAMS['mag']['max_skip_steps']})")
    retention_ratio: float | None = Field(None, description="mag: no skips in this first fraction of "
                                          f"the steps ({PARAMS['mag']['retention_ratio']})")
    mag_ratios: list[float] | None = Field(None, max_length=MAX_RATIOS,
                                           description="mag (required): the model's magnitude ratio per step")

    def spec(self) -> CacheSpec:
        try:
            return CacheSpec.from_obj(self.model_dump(exclude_none=True))
        except CacheError as e:
            raise BodyError(e.field, e.message) from None


class LoraCreate(BaseModel):
    """POST /v1/loras: register an adapter file under a name."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    source: str = Field(min_length=1, max_length=4096,
                        description="a .safetensors path on the server, under one of its --lora-dir folders")

    @field_validator("source")
    @classmethod
    def _no_nul(cls, v: str) -> str:
        """A NUL cannot be in a path: the file system call would fail with a ValueError (500)."""
        if "\x00" in v:
            raise ValueError("must not contain a NUL character")
        return v


def _strict_json(model: type[BaseModel], value: Any) -> Any:
    """``value`` (decoded from a form field's JSON) validated strictly: a form's lax reading of
    text ("1" as a number) does not apply to JSON, whose types are its own."""
    if not isinstance(value, dict):
        return value  # the field's own validation names what is wrong
    try:
        return model.model_validate(value, strict=True)
    except ValidationError as e:
        err = e.errors()[0]
        raise ValueError(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}") from None


class VideoCreate(BaseModel):
    """POST /v1/videos. OpenAI's fields plus ours (send ours via the client's extra_body).

    Validated strictly from JSON (``validate_create(strict=True)``: ``"seed": "7"`` is a
    422) and leniently from a form, whose values are all strings."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=10_000, pattern=r"\S",
                        description="what to generate; the instance's own limit is in /openapi.json")
    model: str | None = None
    size: str | None = Field(None, pattern=SIZE_PATTERN, description='"WIDTHxHEIGHT", e.g. "832x480"')
    width: int | None = None
    height: int | None = None
    seconds: float | Annotated[str, StringConstraints(pattern=SECONDS_PATTERN)] | None = Field(
        None, description='duration, a number or a decimal string as OpenAI sends it ("4"); '
                          "frames = seconds * fps + 1")
    num_frames: int | None = None
    fps: int | None = None
    seed: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    flow_shift: float | None = None
    max_sequence_length: int | None = None
    guidance_scale_2: float | None = Field(None, description="Wan2.2 A14B: the low-noise expert's guidance "
                                           "(default guidance_scale)")
    input_reference: str | dict[str, str] | None = Field(
        None, description="image-to-video: the image as a data URL (data:image/png;base64,...), plain base64 "
                          'or {"image_url": DATA_URL}; in a form, a file part (service.api.images)')
    loras: list[LoraUse] = Field(default_factory=list, max_length=MAX_LORAS,
                                 description="adapters to apply, in order, with their scales")
    cache: CacheUse | None = Field(None, description="step cache: skipped blocks skip their weight transfers "
                                   "too; none given: the server's --cache default")
    priority: int | None = Field(None, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1],
                                 description="lower is served first (vLLM's convention); a better one may "
                                 "pause a worse running job at a step. Default 0 (or the API key's "
                                 "min_priority, where that is worse); not better than that floor")

    @field_validator("cache", mode="before")
    @classmethod
    def _cache_from_form(cls, v: Any) -> Any:
        """A multipart form carries the object as one JSON string."""
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except (json.JSONDecodeError, RecursionError):  # RecursionError: nested too deep
                raise ValueError('must be a JSON object like {"method": "first_block"}') from None
            return _strict_json(CacheUse, v)  # JSON inside a form: its numbers must be numbers
        return v

    @field_validator("loras", mode="before")
    @classmethod
    def _loras_from_form(cls, v: Any) -> Any:
        """A multipart form carries the list as one JSON string."""
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except (json.JSONDecodeError, RecursionError):  # RecursionError: nested too deep
                raise ValueError("must be a JSON list of {name, scale} objects") from None
            return [_strict_json(LoraUse, x) for x in v] if isinstance(v, list) else v
        return v

    @field_validator("prompt", "negative_prompt", "model", "size")
    @classmethod
    def _unicode(cls, value: str | None) -> str | None:
        """Text a tokenizer can read: JSON can carry a lone surrogate ("\\ud800"), UTF-8 cannot."""
        if value is not None:
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("must be valid Unicode text (it holds a lone surrogate such as \\ud800)"
                                 ) from None
        return value

    def to_request(self, defaults: GenerationRequest) -> GenerationRequest:
        """Resolve size/seconds aliases against the service defaults."""
        width, height = self.width, self.height
        if self.size is not None:  # the pattern already holds: ASCII digits, one lower-case x
            if width is not None or height is not None:
                raise BodyError("size", "give either size or width/height, not both")
            w, h = self.size.split("x")
            width, height = int(w), int(h)
        fps = self.fps if self.fps is not None else defaults.fps
        frames = self.num_frames
        if self.seconds is not None:
            seconds = float(self.seconds)
            if frames is not None:
                raise BodyError("seconds", "give either seconds or num_frames, not both")
            if not math.isfinite(seconds) or not 0 <= seconds <= MAX_SECONDS or fps < 1:
                raise BodyError("seconds", f"must be in [0, {MAX_SECONDS}], got {self.seconds}")
            frames = round(seconds * fps) + 1
        extra = {}
        if self.max_sequence_length is not None:
            extra["max_sequence_length"] = self.max_sequence_length
        if self.guidance_scale_2 is not None:
            extra["guidance_scale_2"] = self.guidance_scale_2

        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        return GenerationRequest(
            prompt=self.prompt,
            negative_prompt=pick(self.negative_prompt, defaults.negative_prompt),
            seed=pick(self.seed, defaults.seed),
            height=pick(height, defaults.height),
            width=pick(width, defaults.width),
            num_frames=pick(frames, defaults.num_frames),
            fps=fps,
            num_inference_steps=pick(self.num_inference_steps, defaults.num_inference_steps),
            guidance_scale=pick(self.guidance_scale, defaults.guidance_scale),
            flow_shift=pick(self.flow_shift, defaults.flow_shift),
            extra=extra,
            loras=tuple(LoraRef(u.name, u.scale, u.expert) for u in self.loras),
            cache=None if self.cache is None else self.cache.spec(),
            priority=pick(self.priority, defaults.priority),
        )


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error answer: OpenAI's shape (``detail`` repeats a field error for FastAPI clients)."""

    error: ErrorBody
    detail: list[dict[str, Any]] | None = None


class VideoError(BaseModel):
    code: str
    message: str
    param: str | None = None


class Timings(BaseModel):
    """Seconds per stage of one request (they add up to its latency, within the hand-offs)."""

    queue_s: float | None = Field(None, description="accepted until a rank took it")
    text_encode_s: float | None = Field(None, description="prompt encoding, up to the first forward")
    denoise_s: float | None = Field(None, description="all denoising steps (waits at the lock-step included)")
    step_s: list[float] = Field(default_factory=list, description="each denoising step")
    decode_s: float | None = Field(None, description="VAE decode to uint8 frames")
    encode_s: float | None = Field(None, description="MP4 encoding")
    store_s: float | None = Field(None, description="writing the MP4 and the record (an upload on S3)")
    batch_size: int | None = Field(None, description="the most requests that shared one of its forwards "
                                   "(1: it ran alone; engine/batching.py)")


class Video(BaseModel):
    """The OpenAI video object, plus the generation parameters and where it ran.

    ``status`` adds ``cancelled`` to OpenAI's four: a job stopped by DELETE while it ran
    (its ``error.code`` is "cancelled" too, for clients that know only the four)."""

    model_config = ConfigDict(extra="ignore")

    id: str
    object: Literal["video"] = "video"
    status: Literal["queued", "in_progress", "completed", "failed", "cancelled"]
    progress: int = 0
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    error: VideoError | None = None
    model: str
    prompt: str | None = None
    seconds: str
    size: str
    remixed_from_video_id: str | None = None
    seed: int
    num_frames: int
    fps: int
    num_inference_steps: int
    guidance_scale: float
    loras: list[LoraUse] = Field(default_factory=list, description="the adapters it asked for, in order")
    cache: CacheUse | None = Field(None, description="the step cache it asked for (none: the server's "
                                   "default)")
    dp_rank: int | None = None
    resumed_from_step: int = Field(0, description="its rank died and the run went on from this step of "
                                   "the one before (0: it never resumed)")
    resumable_step: int = Field(0, description="the last step whose state the service keeps while it runs: "
                                "if its rank dies now, the rerun goes on from this step (0: from the start)")
    not_resumable: str = Field("", description="why the service keeps no step of it while it runs, so "
                               "that a rerun would start from step 0 (empty: it keeps them)")
    priority: int = Field(0, description="lower is served first")
    preemptions: int = Field(0, description="times it was paused at a step for a better-priority job "
                             "(each time it went on from that step)")
    dp_group: str | None = Field(None, description="the replica (DP group) that runs it")
    node_id: str | None = Field(None, description="the Ray node of that DP group (admin callers only)")
    timings: Timings | None = Field(None, description="where its time went (once it ended)")


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Video]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class VideoDeleted(BaseModel):
    """``deleted`` false: the job was running and is being cancelled (it ends ``cancelled``
    at its next forward; DELETE it again to remove it)."""

    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True


CONTENT_TYPES = ("application/json", "multipart/form-data", "application/x-www-form-urlencoded")
MAX_FORM_FIELDS = 32  # VideoCreate has 14 fields; more is not a video request


class MediaTypeError(ApiError, ValueError):
    """A content type this API does not read."""

    answer = Answer(415, "unsupported_media_type")


def media_type(content_type: str | None) -> str:
    """The bare media type; MediaTypeError for anything but JSON and the two form types."""
    ctype = (content_type or "application/json").split(";")[0].strip().lower()
    if ctype not in CONTENT_TYPES:
        raise MediaTypeError(f"unsupported content type {ctype!r}; send one of {', '.join(CONTENT_TYPES)}")
    return ctype


async def parse_body(content_type: str, raw: bytes) -> dict[str, Any]:
    """JSON or a form (multipart as ``client.videos.create`` sends it) -> a flat field dict.

    Forms go through Starlette's parsers (python-multipart) with part and field limits;
    nothing here recurses on the input, and a JSON body nested too deep is a 422.
    """
    ctype = media_type(content_type)
    if ctype == "application/json":
        try:
            data = json.loads(raw or b"null")
        except RecursionError:
            raise BodyError("body", "JSON nested too deeply", "json_invalid") from None
        except ValueError as e:
            raise BodyError("body", f"invalid JSON: {e}", "json_invalid") from None
        if not isinstance(data, dict):
            raise BodyError("body", "must be a JSON object", "model_type")
        return data
    from starlette.datastructures import Headers, UploadFile
    from starlette.formparsers import FormParser, MultiPartException, MultiPartParser

    async def stream() -> Any:
        yield raw
        yield b""

    headers = Headers({"content-type": content_type})
    if ctype == "multipart/form-data":
        closing_boundary(content_type, raw)
    try:
        if ctype == "multipart/form-data":
            parser: Any = MultiPartParser(headers, stream(), max_files=1, max_fields=MAX_FORM_FIELDS,
                                          max_part_size=len(raw) + 1)
        else:
            parser = FormParser(headers, stream(), max_fields=MAX_FORM_FIELDS, max_part_size=len(raw) + 1)
        form = await parser.parse()
    except MultiPartException as e:
        field = "input_reference" if "file" in str(e).lower() else "body"
        raise BodyError(field, f"malformed or unsupported form: {e}", "multipart_invalid") from None
    from service.api.images import from_upload

    out: dict[str, Any] = {}
    try:
        for name, value in form.multi_items():
            out[name] = await from_upload(name, value) if isinstance(value, UploadFile) else value
    finally:
        await form.close()  # a file part is spooled to a temporary file
    return out


def closing_boundary(content_type: str, raw: bytes) -> None:
    """A multipart body must end with its closing delimiter (``--BOUNDARY--``): one cut off
    in the middle is not a request (python-multipart would hand over the parts it saw)."""
    m = re.search(r'boundary="?([^";]+)"?', content_type, re.IGNORECASE)
    if m is None:
        return  # no boundary: Starlette's parser says so
    boundary = re.escape(m.group(1).strip().encode("latin-1", "replace"))
    if not re.search(rb"(?:^|\r\n)--" + boundary + rb"--", raw):
        raise BodyError("body", "the multipart body has no closing boundary (--BOUNDARY--): it was cut off",
                        "multipart_invalid")


def validate_create(data: dict[str, Any], strict: bool = True) -> VideoCreate:
    """pydantic validation with the first failing field turned into a BodyError; ``strict``
    for JSON (numbers must be numbers), not for a form (whose values are strings)."""
    for name in NUMERIC_FIELDS & set(data):
        if isinstance(data[name], bool):  # pydantic's lax mode would read true as 1
            raise BodyError(name, "must be a number, not a boolean", "type_error")
        if not strict and isinstance(data[name], str) and not FORM_NUMBER.fullmatch(data[name]):
            raise BodyError(name, f"must be a decimal number as JSON writes one, got {data[name][:40]!r}",
                            "type_error")
    try:
        return VideoCreate.model_validate(data, strict=strict)
    except ValidationError as e:
        err = e.errors()[0]
        loc = err["loc"]
        if len(loc) > 1 and (isinstance(loc[1], int) or loc[0] in NESTED_OBJECTS):
            field = ".".join(str(x) for x in loc)  # an item of a list field (loras.0.scale), cache.method
        else:
            field = str(loc[0]) if loc else "body"  # a union names its branch next: not a field
        raise BodyError(field, err["msg"], err["type"]) from None
