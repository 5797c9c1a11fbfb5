"""The preview of a running request: the demo model's real latents at each step's end,
projected to a small image that changes from step to step."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from service.models import preview
from service.models.request import GenerationRequest

REQ = GenerationRequest(prompt="a fox", seed=3, width=64, height=48, num_frames=5, num_inference_steps=4)


def test_each_steps_latents_project_to_a_different_image(resident) -> None:  # noqa: ANN001
    seen: list[tuple[int, int, torch.Tensor]] = []
    resident.adapter.latents_hook = lambda step, total, latents: seen.append((step, total, latents.clone()))
    try:
        resident.frames(REQ)
    finally:
        resident.adapter.latents_hook = None
    assert [(s, t) for s, t, _ in seen] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    images = [preview.project(preview.latent_frame(x, REQ.height, REQ.width)).numpy() for _, _, x in seen]
    assert all(im.shape == (REQ.height // 8, REQ.width // 8, 3) and im.dtype == np.uint8 for im in images)
    assert all(not np.array_equal(a, b) for a, b in zip(images, images[1:], strict=False))
    data = preview.encode(images[-1])
    decoded = Image.open(io.BytesIO(data))
    assert decoded.format == "WEBP" and decoded.size == (REQ.width // 8, REQ.height // 8)


def test_wan_factors_other_layouts_and_a_bad_shape() -> None:
    frame = torch.zeros(16, 2, 2)
    bias = preview.project(frame)[0, 0].tolist()  # zero latents: the bias alone
    assert bias == [int((b + 1) * 127.5) for b in preview.WAN21_BIAS]
    packed = torch.arange(2 * 3 * 64, dtype=torch.float32).reshape(1, 6, 64)  # Flux: 32x48 -> 2x3 x 16ch
    frame = preview.latent_frame(packed, 32, 48)
    assert frame.shape == (16, 2, 3)
    assert preview.project(torch.randn(48, 4, 5)).shape == (4, 5, 3)  # Wan2.2 TI2V: false colour
    with pytest.raises(ValueError, match="do not fit"):
        preview.latent_frame(packed, 64, 64)
