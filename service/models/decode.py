"""The Wan VAE's decode, chunk by chunk: frames reach the MP4 encoder as the VAE makes them.

diffusers' ``AutoencoderKLWan._decode`` already decodes causally, one latent frame per
decoder call with a feature cache (1 frame from the first latent frame, then 4 from each
next one), and concatenates the chunks at the end; the pipeline then de-normalises the
whole clip. This runs the same calls in the same order and hands each chunk on as soon as
it exists (issue 49: the encoder works while the VAE still decodes). Everything after the
decoder call is per element (clamp, unpatchify, the [-1, 1] -> [0, 1] map, the uint8
rounding), so the chunks are bitwise the frames of the whole decode
(tests/models/test_decode.py). A tiled VAE (``enable_tiling``) or a batch of several
videos decodes whole, as diffusers does, and is handed on in one piece.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .adapter import frames_to_uint8

FramesCallback = Callable[[np.ndarray], None]  # uint8 [t, H, W, 3], in order


def _latents_for_vae(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """What ``WanPipeline.__call__`` does to its latents before ``vae.decode``."""
    from diffusers.utils.torch_utils import get_module_execution_device

    latents = latents.to(get_module_execution_device(vae), dtype=vae.dtype)
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
    std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
    return latents / std + mean


def _tiled(vae: Any, z: torch.Tensor) -> bool:
    """Whether diffusers' ``_decode`` would take its tiled path for ``z``."""
    if not getattr(vae, "use_tiling", False):
        return False
    h, w = z.shape[-2:]
    ratio = vae.spatial_compression_ratio
    return w > vae.tile_sample_min_width // ratio or h > vae.tile_sample_min_height // ratio


@torch.no_grad()
def decode_frames(pipe: Any, latents: torch.Tensor, on_frames: FramesCallback) -> int:
    """Decode ``pipe``'s final latents (``output_type="latent"``) into uint8 frames, each
    causal chunk to ``on_frames`` as it is decoded; the number of frames."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    vae = pipe.vae
    z = _latents_for_vae(vae, latents)

    def emit(video: torch.Tensor) -> int:  # [B, C, t, H, W] in [-1, 1] -> uint8 frames of video 0
        frames = frames_to_uint8(pipe.video_processor.postprocess_video(video, output_type="pt")[0])
        on_frames(frames)
        return len(frames)

    if z.shape[0] != 1 or _tiled(vae, z):
        return emit(vae.decode(z, return_dict=False)[0])
    count = 0
    vae.clear_cache()
    try:
        x = vae.post_quant_conv(z)
        for i in range(x.shape[2]):
            vae._conv_idx = [0]
            out = vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                              first_chunk=i == 0)
            if vae.config.patch_size is not None:
                out = unpatchify(out, patch_size=vae.config.patch_size)
            count += emit(torch.clamp(out, min=-1.0, max=1.0))
    finally:
        vae.clear_cache()
    return count
