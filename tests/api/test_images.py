"""``input_reference`` without a server: parsing (multipart file, data URL, plain base64), the
checks (type by magic bytes, header pixel cap, truncation, size), the body cap, and the
VideoService (fake executor) refusing what the model cannot serve before anything is queued.

The same over real HTTP, with real ranks, is in test_images_http.py.
"""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from service.api import schemas
from service.api.images import ImageTooLarge, body_cap, take_image
from service.api.jobs import JobStore
from service.api.schemas import BodyError
from service.api.service import ServiceConfig, VideoService
from service.models.demo import ensure_demo_model
from service.models.image import check_image, decode_image
from service.models.request import RequestError
from tests.fakes import FakeExecutor

MB = 2**20


def png(width: int = 40, height: int = 30, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims width x height and has no pixel data: refused from the header."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IEND", b"")


def png_bomb(side: int = 30_000) -> bytes:
    """A real, valid side x side 1-bit PNG of zeros: ~110 KB that would decode to 900 MP."""
    z = zlib.compressobj(9)
    row = bytes(1 + (side + 7) // 8)
    data = b"".join(z.compress(row) for _ in range(side)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", data) + _chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def bomb() -> bytes:
    return png_bomb()


def bad_images(bomb: bytes) -> dict[str, bytes]:
    good = png()
    return {"truncated": good[: len(good) // 2], "gif": b"GIF89a" + bytes(40), "empty": b"",
            "bomb": bomb, "header bomb": png_header_only(30_000, 30_000),
            "jpeg magic, no jpeg": b"\xff\xd8\xff" + bytes(64)}


def test_check_image_names_the_field_for_every_bad_kind(bomb: bytes) -> None:
    assert check_image(png(), "input_reference") == ("PNG", 40, 30)
    buf = io.BytesIO()
    Image.new("RGB", (8, 6)).save(buf, "WEBP")
    assert check_image(buf.getvalue())[:1] == ("WEBP",)
    for name, data in bad_images(bomb).items():
        with pytest.raises(RequestError) as e:
            check_image(data, "input_reference")
        assert e.value.field == "input_reference", name
    with pytest.raises(RequestError, match="refused before decoding"):
        check_image(bomb)
    with pytest.raises(RequestError, match="1200 pixels is over the limit of 100"):
        check_image(png(), max_pixels=100)


def test_decode_is_diffusers_load_image(tmp_path: Path) -> None:
    """EXIF orientation applied and RGB, as diffusers.utils.load_image does (an RGBA JPEG-free
    case: a palette PNG with transparency, and a JPEG rotated by its EXIF tag)."""
    from diffusers.utils import load_image

    rgba = Image.fromarray((np.random.default_rng(1).random((20, 30, 4)) * 255).astype(np.uint8), "RGBA")
    jpeg = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 CW
    rgba.convert("RGB").save(jpeg, "JPEG", exif=exif)
    pal = io.BytesIO()
    rgba.convert("P").save(pal, "PNG", transparency=0)
    for name, data in (("jpeg", jpeg.getvalue()), ("palette", pal.getvalue())):
        path = tmp_path / name
        path.write_bytes(data)
        ours, theirs = decode_image(data), load_image(str(path))
        assert ours.mode == "RGB" and ours.size == theirs.size
        assert np.array_equal(np.asarray(ours), np.asarray(theirs)), name
    assert decode_image(jpeg.getvalue()).size == (20, 30)  # rotated: width and height swapped


def test_json_takes_a_data_url_or_plain_base64_and_a_form_a_file() -> None:
    image = png()
    b64 = base64.b64encode(image).decode()
    for value in (f"data:image/png;base64,{b64}", b64, b64[:20] + "\n" + b64[20:],
                  {"image_url": f"data:image/png;base64,{b64}"}):
        assert take_image({"input_reference": value}, MB, 10**6) == image
    assert take_image({"input_reference[image_url]": f"data:image/png;base64,{b64}"}, MB, 10**6) == image
    req = httpx.Request("POST", "http://x/v1/videos", data={"prompt": "a"},
                        files={"input_reference": ("a.png", image, "image/png")})
    fields = asyncio.run(schemas.parse_body(req.headers["content-type"], req.read()))
    assert take_image(fields, MB, 10**6) == image and "input_reference" not in fields
    for bad in ("data:text/plain;base64,aGk=", "not base64!", "data:image/png;base64,@@",
                {"image_url": "https://example.com/a.png"}, {"file_id": "file_1"}, 7):
        with pytest.raises(BodyError) as e:
            take_image({"input_reference": bad}, MB, 10**6)
        assert e.value.field == "input_reference"
    with pytest.raises(ImageTooLarge) as e:
        take_image({"input_reference": b64}, len(image) - 1, 10**6)
    assert e.value.field == "input_reference"
    assert take_image({"prompt": "x"}, MB, 10**6) is None


def test_body_cap_grows_only_where_the_model_takes_an_image() -> None:
    assert body_cap("application/json", 65536, 8 * MB, takes_image=False) == 65536
    assert body_cap("multipart/form-data", 65536, 8 * MB, takes_image=True) == 65536 + 8 * MB
    assert body_cap("application/json", 65536, 3 * MB, takes_image=True) == 65536 + 4 * MB + 1024


@pytest.fixture(scope="module")
def i2v_model() -> str:
    return str(ensure_demo_model("wan22-i2v-tiny"))


@pytest.fixture
def service(i2v_model: str, tmp_path: Path) -> Iterator[tuple[VideoService, FakeExecutor]]:
    ex = FakeExecutor((1,), {})
    store = JobStore(str(tmp_path), {}, 3600.0, 100, 30.0)
    svc = VideoService(ServiceConfig(model=i2v_model, results_url=str(tmp_path), max_image_pixels=10**6),
                       executor=ex, store=store, node_id="node-1")
    try:
        yield svc, ex
    finally:
        svc.close()
        store.close()


def test_the_service_refuses_what_the_model_cannot_serve(service, bomb: bytes) -> None:  # noqa: ANN001
    svc, ex = service
    body = {"prompt": "a fox", "seed": 1, "num_inference_steps": 2}
    for name, data in bad_images(bomb).items():
        with pytest.raises(BodyError) as e:
            svc.create({**body, "input_reference": base64.b64encode(data).decode()})
        assert e.value.field == "input_reference", name
    with pytest.raises(BodyError) as e:  # an image-to-video model without an image
        svc.create(dict(body))
    assert e.value.field == "input_reference" and "required" in e.value.message
    with pytest.raises(BodyError) as e:
        svc.create({**body, "image": base64.b64encode(png()).decode()})  # the wrong field
    assert e.value.field == "image"
    with pytest.raises(BodyError) as e:
        svc.create({**body, "guidance_scale_2": 500, "input_reference": base64.b64encode(png()).decode()})
    assert e.value.field == "guidance_scale_2"
    assert svc.dispatcher.depth == 0 and not ex.assigned  # nothing was queued, no rank was asked
    rec = svc.create({**body, "guidance_scale_2": 3.0, "input_reference": base64.b64encode(png()).decode()})
    ex.wait_assigned(rec.id)
    req = next(r for _, _, job, r in ex.assigned if job == rec.id)
    assert req.image == png() and req.extra == {"guidance_scale_2": 3.0}
    assert '"image":true' in req.compat_key() and "guidance_scale_2" not in req.compat_key()
    assert svc.readiness()["model_card"]["family"] == "wan22-i2v"


def test_an_image_to_a_text_to_video_model_is_refused_naming_input_reference(demo_model: str,
                                                                             tmp_path: Path) -> None:
    ex = FakeExecutor((1,), {})
    store = JobStore(str(tmp_path), {}, 3600.0, 100, 30.0)
    svc = VideoService(ServiceConfig(model=demo_model, results_url=str(tmp_path)), executor=ex, store=store,
                       node_id="node-1")
    try:
        body = {"prompt": "a fox", "seed": 1, "num_inference_steps": 2}
        with pytest.raises(BodyError) as e:
            svc.create({**body, "input_reference": base64.b64encode(png()).decode()})
        assert e.value.field == "input_reference" and "takes no image (t2v only)" in e.value.message, e.value
        with pytest.raises(BodyError) as e:  # a bad image is named the same, whatever the model
            svc.create({**body, "input_reference": "not base64!"})
        assert e.value.field == "input_reference"
        assert svc.dispatcher.depth == 0 and not ex.assigned
        assert svc.readiness()["model_card"]["image_input"] == "none"
        svc.create(dict(body))  # the same body without the image is served
        assert svc.dispatcher.depth + len(ex.assigned) == 1
    finally:
        svc.close()
        store.close()


def test_admission_comes_before_the_image_is_decoded(i2v_model: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A key over its quota (or a full queue) is refused before its image is read: an image
    that decoding would refuse gets the 429's QuotaExceeded, and nothing was decoded."""
    from service.api import images
    from service.api.keys import key_hash
    from service.router.tenants import QuotaExceeded

    decodes: list[int] = []
    real = images.check_image
    monkeypatch.setattr(images, "check_image", lambda *a, **k: (decodes.append(1), real(*a, **k))[1])
    ex = FakeExecutor((1,), {})
    store = JobStore(str(tmp_path), {}, 3600.0, 100, 30.0)
    cfg = ServiceConfig(model=i2v_model, results_url=str(tmp_path), max_queued_per_key=1,
                        api_key_hashes=[key_hash("sk-a-0123456789")])
    svc = VideoService(cfg, executor=ex, store=store, node_id="node-1")
    try:
        a = svc.owner_of("Bearer sk-a-0123456789")
        body = {"prompt": "a fox", "seed": 1, "num_inference_steps": 2}
        ex.wait_assigned(svc.create({**body, "input_reference": base64.b64encode(png()).decode()}, a).id)
        svc.create({**body, "input_reference": base64.b64encode(png()).decode()}, a)  # queued: its quota
        assert len(decodes) == 2
        truncated = png()[:200]  # refused (422) if it were decoded
        with pytest.raises(QuotaExceeded):
            svc.create({**body, "input_reference": base64.b64encode(truncated).decode()}, a)
        assert len(decodes) == 2 and svc.dispatcher.depth == 1
        with pytest.raises(BodyError) as e:  # admitted (another tenant): decoded, and refused for it
            svc.create({**body, "input_reference": base64.b64encode(truncated).decode()}, None)
        assert e.value.field == "input_reference"
    finally:
        svc.close()
        store.close()
    assert len(decodes) == 3


def test_the_pixel_cap_is_the_largest_video_this_instance_makes(i2v_model: str, tmp_path: Path) -> None:
    """Not 16.7 MP: an image over --max-width x --max-height is refused from its header."""
    ex = FakeExecutor((1,), {})
    store = JobStore(str(tmp_path), {}, 3600.0, 100, 30.0)
    cfg = ServiceConfig(model=i2v_model, results_url=str(tmp_path),
                        max_width=64, max_height=48, max_pixels=64 * 48)
    svc = VideoService(cfg, executor=ex, store=store, node_id="node-1")
    try:
        body = {"prompt": "a fox", "seed": 1, "num_inference_steps": 2, "size": "32x32"}
        with pytest.raises(BodyError) as e:
            svc.create({**body, "input_reference": base64.b64encode(png(65, 48)).decode()})
        assert e.value.field == "input_reference" and f"limit of {64 * 48}" in e.value.message, e.value
        svc.create({**body, "input_reference": base64.b64encode(png(64, 48)).decode()})
    finally:
        svc.close()
        store.close()


def test_image_errors_carry_no_library_reprs_and_no_file_bytes() -> None:
    """Pillow quotes ``<_io.BytesIO object at 0x7f..>`` (a heap address); a file that is no
    image is not quoted either (the batch job reads files a client does not own)."""
    for data in (b"\xff\xd8\xff" + b"y" * 40, b"\x89PNG\r\n\x1a\n" + b"x" * 40, b"SECRET-TOKEN-1234"):
        with pytest.raises(RequestError) as e:
            check_image(data)
        assert "0x" not in e.value.message and "<" not in e.value.message, e.value.message
        assert "SECRET" not in e.value.message and "yyy" not in e.value.message
