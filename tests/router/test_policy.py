"""Operator limits and wave deadlines (fast, no Ray)."""

from __future__ import annotations

import pytest

from service.models.request import GenerationRequest, RequestError
from service.router.policy import DeadlinePolicy, Limits


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"width": 2048}, "width"),
        ({"height": 2048}, "height"),
        ({"width": 1280, "height": 1280}, "size"),
        ({"num_frames": 161}, "num_frames"),
        ({"num_inference_steps": 101}, "num_inference_steps"),
        ({"prompt": "x" * 2001}, "prompt"),
    ],
)
def test_limits_name_the_field(kw: dict, field: str) -> None:
    req = GenerationRequest(**{"prompt": "ok", **kw})
    with pytest.raises(RequestError) as e:
        Limits().check(req)
    assert e.value.field == field


def test_limits_pass_a_normal_request() -> None:
    Limits().check(GenerationRequest(prompt="ok", width=832, height=480, num_frames=81))


def test_deadline_scales_with_steps_cfg_and_shape() -> None:
    d = DeadlinePolicy(base_s=10, per_forward_s=1.0, ref_pixels_frames=832 * 480 * 81)
    tiny = GenerationRequest(prompt="x", num_inference_steps=2, guidance_scale=5.0)
    assert d.deadline_s([tiny]) == 10 + 4  # 2 steps x CFG = 4 forwards, shape below reference
    no_cfg = GenerationRequest(prompt="x", num_inference_steps=2, guidance_scale=1.0)
    assert d.deadline_s([no_cfg]) == 12
    big = GenerationRequest(prompt="x", width=1664, height=960, num_frames=81, num_inference_steps=2)
    assert d.deadline_s([big]) == 10 + 4 * 4  # 4x the reference pixels x frames
    assert d.deadline_s([tiny, big]) == d.deadline_s([big])  # the wave waits for its slowest
