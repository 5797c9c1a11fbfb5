"""Body parsing and field resolution, without a server (fast)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from service.api import schemas
from service.api.schemas import BodyError, MediaTypeError, validate_create
from service.models.request import GenerationRequest

DEFAULTS = GenerationRequest(prompt="-")


def parse_body(ctype: str, raw: bytes) -> dict:
    return asyncio.run(schemas.parse_body(ctype, raw))


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
        strict = ctype == "application/json"  # a form's numbers are strings
        reqs.append(validate_create(parse_body(ctype, raw), strict=strict).to_request(DEFAULTS))
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
    for ctype, raw in (("application/json", b"[1]"), ("application/json", b"{")):
        with pytest.raises(BodyError):
            parse_body(ctype, raw)
    with pytest.raises(MediaTypeError):
        parse_body("text/plain", b"x")
    ctype, raw = encoded(files={"image": ("a.png", b"\x89PNG", "image/png")})
    with pytest.raises(BodyError) as e:  # a file under any other name than input_reference
        parse_body(ctype, raw)
    assert e.value.field == "image"
    ctype, raw = encoded(data={"prompt": "x"}, files={"input_reference": ("a.png", b"\x89PNG", "image/png")})
    upload = parse_body(ctype, raw)["input_reference"]  # checked later, against the model
    assert (upload.data, upload.filename, upload.content_type) == (b"\x89PNG", "a.png", "image/png")


def test_deep_nesting_is_a_422_not_a_crash() -> None:
    deep = b'{"prompt": ' + b"[" * 30000 + b"]" * 30000 + b"}"
    with pytest.raises(BodyError) as e:
        parse_body("application/json", deep)
    assert "nested" in e.value.message
    ctype, raw = encoded(files={"prompt": (None, "x"), "seed": (None, "1")})
    nested = raw  # multipart inside a part, 2,000 levels: python-multipart does not recurse
    for i in range(2000):
        b = f"b{i}".encode()
        nested = (b"--" + b + b'\r\nContent-Disposition: form-data; name="prompt"\r\n'
                  b"Content-Type: multipart/form-data; boundary=" + f"b{i - 1}".encode() + b"\r\n\r\n"
                  + nested + b"\r\n--" + b + b"--\r\n")
    fields = parse_body("multipart/form-data; boundary=b1999", nested)
    assert set(fields) == {"prompt"}  # one opaque text field, then pydantic's length rule


def test_too_many_form_fields_is_a_422() -> None:
    ctype, raw = encoded(data={f"f{i}": "x" for i in range(100)})
    with pytest.raises(BodyError):
        parse_body(ctype, raw)


def test_form_values_that_are_not_utf8_are_read_as_latin1() -> None:
    """Starlette's rule for form parts: no 500, the bytes become a string."""
    ctype, raw = encoded(files={"prompt": (None, "a fox")})
    assert parse_body(ctype, raw.replace(b"a fox", b"\xff\xfe")) == {"prompt": "\xff\xfe"}
    assert parse_body("application/x-www-form-urlencoded", b"prompt=\xff\xfe") == {"prompt": "\xff\xfe"}


def test_cache_object_json_and_form_and_its_errors() -> None:
    from service.config.cache import CacheSpec

    want = CacheSpec("first_block", threshold=0.1)
    for ctype, raw in (encoded(json={"prompt": "a", "cache": {"method": "first_block", "threshold": 0.1}}),
                       encoded(files={"prompt": (None, "a"),
                                      "cache": (None, '{"method": "first_block", "threshold": 0.1}')})):
        assert validate_create(parse_body(ctype, raw)).to_request(DEFAULTS).cache == want
    assert validate_create({"prompt": "a"}).to_request(DEFAULTS).cache is None  # the server default
    for cache, field in (({"method": "tea"}, "cache.method"), ({"threshold": 1}, "cache.method"),
                         ({"method": "mag"}, "cache.mag_ratios"), ("{oops", "cache"),
                         ({"method": "first_block", "threshold": 99}, "cache.threshold"),
                         ({"method": "first_block", "retention_ratio": 0.5}, "cache.retention_ratio"),
                         ({"method": "first_block", "x": 1}, "cache.x")):
        with pytest.raises(BodyError) as e:
            validate_create({"prompt": "a", "cache": cache}).to_request(DEFAULTS)
        assert e.value.field == field, cache


@pytest.mark.parametrize(("body", "field"), [
    ({"prompt": "x", "negative_prompt": "\ud800"}, "negative_prompt"),  # a lone surrogate
    ({"prompt": "a \udfff b"}, "prompt"),
    ({"prompt": "x", "size": "32X32"}, "size"),
    ({"prompt": "x", "size": " 32 x 32 "}, "size"),
    ({"prompt": "x", "size": "\u0663\u0662x\u0663\u0662"}, "size"),  # Arabic-Indic digits
    ({"prompt": "x", "size": "\uff13\uff12x\uff13\uff12"}, "size"),  # fullwidth digits
    ({"prompt": "x", "size": "032x32"}, "size"),  # not what the schema's pattern allows either
    ({"prompt": "x", "size": "32x32\n"}, "size"),
    ({"prompt": "x", "seed": "7"}, "seed"),  # JSON: a number must be a number
    ({"prompt": "x", "guidance_scale": "5"}, "guidance_scale"),
    ({"prompt": "x", "num_inference_steps": 2.0}, "num_inference_steps"),
    ({"prompt": "x", "seconds": "four"}, "seconds"),
])
def test_json_bodies_are_read_as_strictly_as_the_schema_says(body: dict, field: str) -> None:
    with pytest.raises(BodyError) as e:
        validate_create(body).to_request(DEFAULTS)
    assert e.value.field == field, e.value


def test_seconds_may_be_a_decimal_string_as_openai_sends_it_and_forms_stay_strings() -> None:
    assert validate_create({"prompt": "x", "seconds": "0.5"}).to_request(DEFAULTS).num_frames == 5
    form = validate_create({"prompt": "x", "seed": "7", "size": "48x32"}, strict=False).to_request(DEFAULTS)
    assert (form.seed, form.width) == (7, 48)


def test_a_multipart_body_cut_before_its_closing_boundary_is_a_422() -> None:
    ctype, raw = encoded(files={"prompt": (None, "a fox"), "seed": (None, "1")})
    assert parse_body(ctype, raw)["prompt"] == "a fox"
    cut = raw[: raw.rindex(b"--")]  # everything but the final "--" and what follows
    for body in (cut, raw[: raw.index(b"a fox") + 5]):
        with pytest.raises(BodyError) as e:
            parse_body(ctype, body)
        assert e.value.kind == "multipart_invalid" and "closing boundary" in e.value.message


@pytest.mark.parametrize("field", ["loras", "cache"])
def test_json_nested_50000_deep_inside_a_form_field_is_a_422_naming_it(field: str) -> None:
    ctype, raw = encoded(data={"prompt": "x", field: "[" * 50000 + "]" * 50000})
    fields = parse_body(ctype, raw)
    with pytest.raises(BodyError) as e:
        validate_create(fields, strict=False)
    assert e.value.field == field, e.value.message


def test_a_nul_in_an_adapter_source_is_a_field_error() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as e:
        schemas.LoraCreate.model_validate({"name": "style", "source": "/loras/a\x00.safetensors"})
    assert e.value.errors()[0]["loc"] == ("source",)


def test_cache_use_states_the_defaults_cache_spec_applies() -> None:
    """The body's ``cache`` documents each parameter's default from CacheSpec's own table (one
    place): what the description says is what a request that leaves it out gets."""
    from service.api.schemas import CacheUse
    from service.config.cache import CacheSpec

    fields = CacheUse.model_fields
    for method, name in (("first_block", "threshold"), ("mag", "threshold"), ("mag", "max_skip_steps"),
                         ("mag", "retention_ratio")):
        default = CacheSpec(method).value(name)
        assert f"{default}" in (fields[name].description or ""), (method, name)
    assert CacheUse(method="first_block").spec() == CacheSpec("first_block")


def test_a_forms_numbers_are_decimal_as_json_writes_them() -> None:
    """Python's int() reads "4_0" as 40 and pydantic's lax mode "+4" and " 4" as 4: a form's
    field is refused instead, naming it, as JSON refuses them."""
    for bad in ("4_0", "+4", " 4", "4 ", "0x10", "1e", "four"):
        with pytest.raises(BodyError) as e:
            validate_create({"prompt": "p", "priority": bad}, strict=False)
        assert e.value.field == "priority", bad
    with pytest.raises(BodyError) as e:
        validate_create({"prompt": "p", "seed": "1_000"}, strict=False)
    assert e.value.field == "seed"
    ok = validate_create({"prompt": "p", "priority": "-4", "seed": "7", "guidance_scale": "4.5",
                          "seconds": "4"}, strict=False)
    assert (ok.priority, ok.seed, ok.guidance_scale) == (-4, 7, 4.5)
