"""The VAE decoded chunk by chunk (models/decode.py) gives the whole decode's frames, bit for bit.

The demo model's VAE is diffusers' ``AutoencoderKLWan`` with Wan's latent layout, so a clip
of 9 frames is 3 latent frames: chunks of 1, 4 and 4 frames, in order.
"""

from __future__ import annotations

import numpy as np
import pytest

from service.models.request import GenerationRequest

REQ = GenerationRequest(prompt="a red square moving right", seed=7, num_frames=9, num_inference_steps=2)


def test_chunks_are_the_whole_decode(resident) -> None:  # noqa: ANN001
    whole = resident.frames(REQ)
    chunks: list[np.ndarray] = []
    assert resident.frames(REQ, on_frames=chunks.append) is None
    assert [len(c) for c in chunks] == [1, 4, 4]
    assert all(c.dtype == np.uint8 and c.flags.c_contiguous for c in chunks)
    assert np.array_equal(np.concatenate(chunks), whole)


def test_a_tiled_vae_decodes_whole(resident) -> None:  # noqa: ANN001
    """diffusers' tiled path is not causal per latent frame here: one chunk, the same frames."""
    vae = resident.adapter._parts["vae"]
    whole = resident.frames(REQ)
    vae.enable_tiling(tile_sample_min_height=16, tile_sample_min_width=16,
                      tile_sample_stride_height=8, tile_sample_stride_width=8)
    try:
        tiled = resident.frames(REQ)
        chunks: list[np.ndarray] = []
        resident.frames(REQ, on_frames=chunks.append)
    finally:
        vae.disable_tiling()
    assert len(chunks) == 1 and np.array_equal(chunks[0], tiled)
    assert tiled.shape == whole.shape


def test_a_decode_error_mid_clip_reaches_the_caller(resident) -> None:  # noqa: ANN001
    """A sink that raises (the rank's cancel, say) stops the decode: no later chunk comes."""
    before = resident.frames(REQ)
    seen: list[int] = []

    def sink(frames: np.ndarray) -> None:
        seen.append(len(frames))
        if len(seen) == 2:
            raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        resident.frames(REQ, on_frames=sink)
    assert seen == [1, 4]
    assert np.array_equal(resident.frames(REQ), before)  # the VAE's causal cache was cleared
