"""The OpenAPI schema of one instance: the create body's limits are this instance's own.

FastAPI derives the schema from the pydantic models, which know only the hard ceilings.
The limits a request meets here depend on the operator's settings (``Limits``) and on the
model (the Wan VAE x patch makes sizes multiples of 16 and frame counts 4k+1; Flux makes
one frame). This fills them in, so a client or a schema fuzzer sees the rules the code
applies. Rules across fields cannot be written in JSON Schema and stay 422s: size or
width/height but not both, seconds or num_frames but not both, frames from seconds x fps
that are not 4k+1 or over the limit, and the pixel budget (width x height). The budget is
still stated, as ``x-max-pixels`` on ``size``, ``width`` and ``height`` (an OpenAPI extension:
validators ignore it; the playground at /ui shows it before submit).
"""

from __future__ import annotations

import copy
from typing import Any

from service.api.schemas import MAX_SECONDS
from service.models.adapter import ModelAdapter
from service.router.policy import Limits

CREATE_PATHS = ("/v1/videos", "/v1/videos/sync")


def inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic schema with its ``$defs`` put in place (an OpenAPI document has no root $defs)."""
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return walk(dict(defs[ref.rsplit("/", 1)[1]]))
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(schema)


def body_rules(adapter: ModelAdapter, limits: Limits, model_name: str) -> dict[str, dict[str, Any]]:
    """JSON Schema keywords per create-body field, from the model and the operator limits."""
    multiple = getattr(adapter, "multiple", 1)  # Wan: (h, w); Flux: one number
    mh, mw = multiple if isinstance(multiple, tuple) else (multiple, multiple)
    temporal = getattr(adapter, "temporal", None)  # Wan: frames are temporal*k + 1
    frames = list(range(1, limits.max_frames + 1, temporal)) if temporal else [1]
    widths = list(range(mw, limits.max_width + 1, mw))
    heights = list(range(mh, limits.max_height + 1, mh))
    size = f"^({'|'.join(map(str, widths))})x({'|'.join(map(str, heights))})$"
    text = {"maxLength": limits.max_prompt_chars}
    pixels = {"x-max-pixels": limits.max_pixels}  # width x height: a 422 beyond it, see above
    rules: dict[str, dict[str, Any]] = {
        "prompt": {"minLength": 1, "pattern": r"\S", **text},
        "negative_prompt": text,
        "model": {"enum": [model_name]},
        "size": {"pattern": size, **pixels},
        "width": {"minimum": mw, "maximum": widths[-1], "multipleOf": mw, **pixels},
        "height": {"minimum": mh, "maximum": heights[-1], "multipleOf": mh, **pixels},
        "num_frames": {"enum": frames},
        "fps": {"minimum": 1, "maximum": 240},
        "seed": {"minimum": 0, "maximum": 2**63 - 1},
        "num_inference_steps": {"minimum": 1, "maximum": limits.max_steps},
        "guidance_scale": {"minimum": 0, "maximum": 100},
        "flow_shift": {"minimum": 0.001, "maximum": 100},
        "max_sequence_length": {"minimum": 1, "maximum": 512},
        "seconds": {"minimum": 0, "maximum": MAX_SECONDS},
        "guidance_scale_2": {"minimum": 0, "maximum": 100},
    }
    if len(adapter.experts) == 1:  # only Wan2.2 A14B has a second guidance scale
        rules["guidance_scale_2"] = {"not": {}}
    if adapter.image_input == "none":  # an image is refused (422) by a model that takes none
        rules["input_reference"] = {"not": {}}
    if adapter.family == "flux-t2i":  # refused fields (see FluxAdapter.validate)
        rules["negative_prompt"] = {"maxLength": 0}
        rules["flow_shift"] = {"not": {}}
    return rules


def instance_openapi(base: dict[str, Any], rules: dict[str, dict[str, Any]],
                     required: tuple[str, ...] = ()) -> dict[str, Any]:
    """``base`` (FastAPI's schema) with the create bodies' field rules filled in; ``required``:
    fields this model needs besides the prompt (an image-to-video model's input_reference)."""
    spec = copy.deepcopy(base)
    for path in CREATE_PATHS:
        body = spec.get("paths", {}).get(path, {}).get("post", {}).get("requestBody", {})
        for ctype, media in body.get("content", {}).items():
            props = media.get("schema", {}).get("properties", {})
            for name, extra in rules.items():
                if name not in props:
                    continue
                if extra == {"not": {}}:  # refused by this model: no value is valid, whatever its type
                    props[name] = {"not": {}}
                    continue
                prop = props[name]
                variants = prop.get("anyOf")  # "T | None": the rules go on the non-null branch
                target = next((v for v in variants if v.get("type") != "null"), prop) if variants else prop
                for key in ("maxLength", "minLength", "pattern", "minimum", "maximum"):
                    target.pop(key, None)
                target.update(extra)
                if variants and ctype == "multipart/form-data":
                    # A form has no null: a field is sent or it is not.
                    props[name] = {**{k: v for k, v in prop.items() if k not in ("anyOf", "default")},
                                   **target}
            media["schema"]["not"] = {"anyOf": [_both(a, b) for a, b in EXCLUSIVE]}
            if required:
                media["schema"]["required"] = sorted(set(media["schema"].get("required", [])) | set(required))
    return spec


EXCLUSIVE = (("size", "width"), ("size", "height"), ("seconds", "num_frames"))


def _both(a: str, b: str) -> dict[str, Any]:
    """Both fields given (and not null): one of each pair only."""
    return {"required": [a, b], "properties": {a: {"not": {"type": "null"}}, b: {"not": {"type": "null"}}}}
