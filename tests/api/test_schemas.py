"""Body parsing and field resolution, without a server (fast)."""

from __future__ import annotations

import httpx
import pytest

from service.api.schemas import BodyError, parse_body, validate_create
from service.models.request import GenerationRequest

DEFAULTS = GenerationRequest(prompt="-")


def encoded(**kw: object) -> tuple[str, bytes]:
    req = httpx.Request("POST", "http://x/v1/videos", **kw)
    return req.headers["content-type"], req.read()


def test_json_multipart_and_urlencoded_give_the_same_request() -> None:
    fields = {"prompt": "a fox", "size": "48x32", "seconds": "1", "seed": "7"}
    reqs = []
    for ctype, raw in (
        encoded(json={"prompt": "a fox", "size": "48x32", "seconds": 1, "seed": 7}),
        encoded(data=fields),
        encoded(files={k: (None, v.encode()) for k, v in fields.items()}),
    ):
        reqs.append(validate_create(parse_body(ctype, raw)).to_request(DEFAULTS))
    assert reqs[0] == reqs[1] == reqs[2]
    r = reqs[0]
    assert (r.width, r.height, r.num_frames, r.seed) == (48, 32, DEFAULTS.fps + 1, 7)


def test_field_errors_name_the_field() -> None:
    cases = [
        ({"prompt": "x", "extra_thing": 1}, "extra_thing"),
        ({"prompt": "x", "seed": "abc"}, "seed"),
        ({"prompt": "x", "size": "10by10"}, "size"),
        ({"prompt": "x", "size": "32x32", "width": 32}, "size"),
        ({"prompt": "x", "seconds": 1, "num_frames": 9}, "seconds"),
        ({"prompt": "x", "seconds": -1}, "seconds"),
        ({"seed": 1}, "prompt"),
    ]
    for body, field in cases:
        with pytest.raises(BodyError) as e:
            validate_create(body).to_request(DEFAULTS)
        assert e.value.field == field, (body, e.value)


def test_unreadable_bodies() -> None:
    for ctype, raw in (("application/json", b"[1]"), ("application/json", b"{"), ("text/plain", b"x")):
        with pytest.raises(BodyError):
            parse_body(ctype, raw)
    ctype, raw = encoded(files={"input_reference": ("a.png", b"\x89PNG", "image/png")})
    with pytest.raises(BodyError) as e:
        parse_body(ctype, raw)
    assert e.value.field == "input_reference"


def test_bodies_that_are_not_utf8_are_the_clients_error() -> None:
    with pytest.raises(BodyError) as e:
        parse_body("application/x-www-form-urlencoded", b"prompt=\xff\xfe")
    assert e.value.field == "body"
    ctype, raw = encoded(files={"prompt": (None, "a fox")})
    with pytest.raises(BodyError) as e:
        parse_body(ctype, raw.replace(b"a fox", b"\xff\xfe"))
    assert e.value.field == "prompt"
