"""``input_reference``: the image of an image-to-video request, as the HTTP API takes it.

Two ways in, one check (``service.models.image.check_image``), all before any compute:

- **multipart/form-data** (what the openai client's ``videos.create(input_reference=...)``
  sends): a file part named ``input_reference``. A file part of any other name is a 422
  naming it.
- **JSON** (and a text part of a form): a string, either a data URL
  ``data:image/png;base64,...`` (``image/png``, ``image/jpeg`` or ``image/webp``) or plain
  base64 (standard alphabet, padding required, whitespace ignored); or OpenAI's reference
  object ``{"image_url": "data:image/png;base64,..."}`` (a form sends it as the field
  ``input_reference[image_url]``). The service never fetches a URL itself: an ``http(s)``
  ``image_url`` or a ``file_id`` is a 422 (send the image's bytes).

Size limits (``--max-body-bytes`` stays the limit of every body without an image): where the
model takes an image, a JSON or form body may also carry one, so its cap grows by the image's
encoded size: ``--max-image-bytes`` for a file part, 4/3 of it (base64) for a string. The
decoded file must itself be within ``--max-image-bytes`` (else 413 naming input_reference), and
its header within ``--max-image-pixels`` (422). A model that takes no image keeps the small cap,
and an image sent to it is a 422 naming input_reference.
"""

from __future__ import annotations

import base64
import binascii
import copy
import re
from dataclasses import dataclass
from typing import Any

from service.api.errors import Answer, BodyError
from service.models.image import check_image
from service.models.request import RequestError

FIELD = "input_reference"
DATA_URL = re.compile(r"data:(image/(?:png|jpeg|webp));base64,", re.IGNORECASE)
SLACK = 1024  # the data URL prefix and JSON quoting around a base64 image


class ImageTooLarge(BodyError):
    """The decoded image is over --max-image-bytes."""

    answer = Answer(413, "image_too_large", metric="rejected")


@dataclass(frozen=True)
class UploadedImage:
    """A file part of a multipart body (only ``input_reference`` may be one)."""

    data: bytes
    filename: str | None = None
    content_type: str | None = None


async def from_upload(name: str, upload: Any) -> UploadedImage:
    """A multipart file part -> its bytes; a file under any other field name is a 422."""
    if name != FIELD:
        raise BodyError(name, f"only {FIELD} takes a file (an image for image-to-video)")
    data = await upload.read()
    return UploadedImage(data, upload.filename, upload.content_type)


def body_cap(media_type: str, max_body_bytes: int, max_image_bytes: int, takes_image: bool) -> int:
    """The most bytes of a body read for this media type and model."""
    if not takes_image:
        return max_body_bytes
    if media_type == "multipart/form-data":
        return max_body_bytes + max_image_bytes
    return max_body_bytes + -(-max_image_bytes // 3) * 4 + SLACK  # base64 in JSON or a form field


def take_image(fields: dict[str, Any], max_bytes: int, max_pixels: int) -> bytes | None:
    """Pop ``input_reference`` from the parsed body: the checked image file's bytes, or None.

    BodyError (422) naming input_reference when it is not a valid PNG/JPEG/WebP within the
    pixel cap; ImageTooLarge (413) over ``max_bytes``.
    """
    value = fields.pop(FIELD, None)
    nested = fields.pop(f"{FIELD}[image_url]", None)  # the reference object, as a form sends it
    if value is None and nested is not None:
        value = {"image_url": nested}
    if value is None:
        return None
    if isinstance(value, dict):
        value = _reference_object(value)
    if isinstance(value, UploadedImage):
        data = value.data
    elif isinstance(value, str):
        data = _decode_base64(value, max_bytes)
    else:
        raise BodyError(FIELD, "must be an image file (multipart) or a base64 string / data URL (JSON)")
    if len(data) > max_bytes:
        raise ImageTooLarge(FIELD, f"the image file is {len(data)} bytes, over the limit of {max_bytes}",
                            "image_too_large")
    try:
        check_image(data, FIELD, max_pixels=max_pixels)
    except RequestError as e:
        raise BodyError(FIELD, e.message, "invalid_image") from None
    return data


def _reference_object(value: dict[str, Any]) -> str:
    """OpenAI's ``{"image_url": ...}``: the data URL inside it (nothing is fetched)."""
    url = value.get("image_url")
    if set(value) != {"image_url"} or not isinstance(url, str):
        raise BodyError(FIELD, "a reference object must be {\"image_url\": \"data:image/...;base64,...\"} "
                               "(file_id is not supported: send the image)")
    if not url.lower().startswith("data:"):
        raise BodyError(FIELD, "image_url must be a base64 data URL: the service fetches no URLs")
    return url


def _decode_base64(value: str, max_bytes: int) -> bytes:
    m = DATA_URL.match(value)
    body = value[m.end():] if m else value
    if not m and value.lstrip().lower().startswith("data:"):
        raise BodyError(FIELD, "a data URL must be data:image/png|jpeg|webp;base64,...")
    body = "".join(body.split())
    if len(body) > -(-max_bytes // 3) * 4:
        raise ImageTooLarge(FIELD, f"the base64 image is over the limit of {max_bytes} bytes decoded",
                            "image_too_large")
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BodyError(FIELD, f"not valid base64 (standard alphabet, padded): {e}") from None


def create_body(schema: dict[str, Any]) -> dict[str, Any]:
    """The create endpoints' request bodies: JSON takes ``input_reference`` as a string, a form
    as a file (binary)."""
    form = copy.deepcopy(schema)
    form.setdefault("properties", {})[FIELD] = {
        "type": "string", "format": "binary",
        "description": "the image (PNG, JPEG or WebP) of an image-to-video request, as a file part"}
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": schema},
        "multipart/form-data": {"schema": form},
    }}}
