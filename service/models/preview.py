"""A small image of a running request's latents: the preview ``GET /v1/videos/{id}/preview`` shows.

A linear latent-to-RGB projection of one latent frame, not a VAE decode: measured on CPU
with the demo model (loadtest/preview_cost.py, docs/service.md) it costs a small fraction of
a step where a one-frame VAE decode costs about as much as a step or more. The projection
reads the latents as the step left them (the scheduler's current sample, which becomes the
video at the last step), first latent frame (Wan's causal VAE encodes the video's first
frame alone into it).

Wan2.1 (16 channels, also the A14B and I2V families): the published latent-to-RGB factors
for its VAE (as tabulated in ComfyUI's ``latent_formats.Wan21``). Other layouts (Wan2.2
TI2V's 48 channels, Flux's packed 2x2 latents): a false-colour view, the mean of three
channel groups stretched to the image's own range; it shows the composition forming, not
the colours.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the front end reads MEDIA_TYPE only, and starts without torch
    import numpy as np
    import torch

WAN21_RGB = (
    (-0.1299, -0.1692, 0.2932), (0.0671, 0.0406, 0.0442), (0.3568, 0.2548, 0.1747),
    (0.0372, 0.2344, 0.1420), (0.0313, 0.0189, -0.0328), (0.0296, -0.0956, -0.0665),
    (-0.3477, -0.4059, -0.2925), (0.0166, 0.1902, 0.1975), (-0.0412, 0.0267, -0.1364),
    (-0.1293, 0.0740, 0.1636), (0.0680, 0.3019, 0.1128), (0.0032, 0.0581, 0.0639),
    (-0.1251, 0.0927, 0.1699), (0.0060, -0.0633, 0.0005), (0.3477, 0.2275, 0.2950),
    (0.1984, 0.0913, 0.1861),
)
WAN21_BIAS = (-0.1835, -0.0868, -0.3360)
MEDIA_TYPE = "image/webp"


def latent_frame(latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """One frame [C, h, w] of a batch's first sample: video latents [B, C, T, h, w], image
    latents [B, C, h, w], or Flux's packed [B, (H/16)(W/16), 4C] (unpacked to its 2x2 mean)."""
    if latents.dim() == 5:
        return latents[0, :, 0]
    if latents.dim() == 4:
        return latents[0]
    if latents.dim() == 3:
        h, w = height // 16, width // 16
        seq, packed = latents.shape[1], latents.shape[2]
        if h * w != seq or packed % 4:
            raise ValueError(f"packed latents {tuple(latents.shape)} do not fit {width}x{height}")
        return latents[0].reshape(h, w, packed // 4, 4).mean(-1).permute(2, 0, 1)
    raise ValueError(f"no preview for latents of shape {tuple(latents.shape)}")


def project(frame: torch.Tensor) -> torch.Tensor:
    """uint8 RGB [h, w, 3] of a latent frame [C, h, w], on the frame's device."""
    import torch

    x = frame.float()
    if x.shape[0] == len(WAN21_RGB):
        m = torch.tensor(WAN21_RGB, device=x.device)
        rgb = torch.einsum("chw,cr->hwr", x, m) + torch.tensor(WAN21_BIAS, device=x.device)
        return ((rgb.clamp(-1, 1) + 1) * 127.5).to(torch.uint8)
    groups = torch.stack([g.mean(0) for g in x.tensor_split(3, dim=0)], dim=-1)  # [h, w, 3]
    lo, hi = groups.amin(), groups.amax()
    return ((groups - lo) / (hi - lo).clamp_min(1e-6) * 255).to(torch.uint8)


def encode(rgb: np.ndarray, quality: int = 80) -> bytes:
    """WebP bytes of uint8 [h, w, 3] (the smallest of PNG, JPEG and WebP at these sizes)."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(out, "WEBP", quality=quality, method=0)
    return out.getvalue()
