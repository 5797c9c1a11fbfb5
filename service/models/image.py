"""The conditioning image of an image-to-video request: checked once at the edge, decoded on the rank.

Every front end (HTTP, the batch job, ``dloserve generate``) hands the file's bytes to
``check_image`` before any compute: the type comes from the magic bytes (PNG, JPEG, WebP;
nothing else is given to a decoder), the pixel count from the header before a pixel is
decoded (a 30,000 x 30,000 PNG is refused from its first 33 bytes), and then one full decode
catches truncated or corrupt data. The request carries the bytes, never a decoded image, so
the same file gives the same video from every front end.

``decode_image`` is what the rank feeds the pipeline, and it does what diffusers' own
``load_image`` does: EXIF orientation applied, then RGB (alpha dropped, palettes and
greyscale expanded). Fitting to the requested size is the pipeline's: Wan's
``VideoProcessor.preprocess`` stretches the image to exactly width x height with Lanczos (no
crop, no padding: crop to the aspect first to keep it); Wan2.1 I2V's CLIP image processor
separately resizes the shorter side and centre-crops to its own square (224 for ViT-H/14).
"""

from __future__ import annotations

import io
import re
import warnings
from typing import Any

from .request import RequestError

# Default decoded-size cap: 16.7 MP (4096 x 4096). Far above any size a Wan model is run at
# (1280 x 720 is 0.9 MP) and far below what a bomb expands to (30,000^2 x 3 bytes = 2.7 GB).
MAX_IMAGE_PIXELS = 4096 * 4096
MAX_IMAGE_BYTES = 16 * 2**20  # the encoded file (the HTTP service's --max-image-bytes default)
MAGIC = (("PNG", b"\x89PNG\r\n\x1a\n"), ("JPEG", b"\xff\xd8\xff"))


def sniff(data: bytes) -> str | None:
    """The image type by its magic bytes: "PNG", "JPEG", "WEBP", or None."""
    for name, magic in MAGIC:
        if data.startswith(magic):
            return name
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def plain(e: BaseException) -> str:
    """A library's message without the reprs it quotes (``<_io.BytesIO object at 0x7f..>``:
    a heap address is no business of a client's)."""
    return re.sub(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>", "", str(e))


def check_image(data: bytes, field: str = "image", max_pixels: int = MAX_IMAGE_PIXELS,
                max_bytes: int | None = None) -> tuple[str, int, int]:
    """(type, width, height) of a valid image; RequestError naming ``field`` otherwise.

    In order: empty, over ``max_bytes``, not PNG/JPEG/WebP by magic bytes, a header Pillow
    cannot read, more than ``max_pixels`` pixels (read from the header, nothing decoded),
    then a full decode (a truncated or corrupt file fails here).
    """
    from PIL import Image, UnidentifiedImageError

    if not isinstance(data, bytes | bytearray):
        raise RequestError(field, f"must be image file bytes, got {type(data).__name__}")
    if not data:
        raise RequestError(field, "the image file is empty (0 bytes)")
    if max_bytes is not None and len(data) > max_bytes:
        raise RequestError(field, f"the image file is {len(data)} bytes, over the limit of {max_bytes}")
    kind = sniff(bytes(data[:16]))
    if kind is None:
        raise RequestError(field, "not a PNG, JPEG or WebP image (by its first bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own cap is below
            img = Image.open(io.BytesIO(data), formats=[kind])  # lazy: the header only
    except Image.DecompressionBombError as e:  # Pillow's own cap (2 x MAX_IMAGE_PIXELS), from the header
        raise RequestError(field, f"{kind} is over the limit of {max_pixels} pixels (refused before "
                                  f"decoding): {plain(e)}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise RequestError(field, f"unreadable {kind} header: {plain(e)}") from None
    width, height = img.size
    if width < 1 or height < 1:
        raise RequestError(field, f"{kind} of {width}x{height} pixels has no pixels")
    if width * height > max_pixels:
        raise RequestError(field, f"{kind} of {width}x{height} = {width * height} pixels is over the "
                                  f"limit of {max_pixels} (refused before decoding)")
    try:
        img.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise RequestError(field, f"{kind} data is truncated or corrupt: {plain(e)}") from None
    return kind, width, height


def decode_image(data: bytes) -> Any:
    """The PIL RGB image the pipeline gets: as diffusers' ``load_image`` (EXIF orientation, RGB)."""
    from PIL import Image, ImageOps

    img = Image.open(io.BytesIO(data), formats=[sniff(data[:16]) or "PNG"])
    img = ImageOps.exif_transpose(img)
    return img.convert("RGB")
