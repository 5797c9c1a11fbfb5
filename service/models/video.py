"""H.264 MP4 encoding with PyAV, byte-reproducible.

Same frames -> same bytes is what lets the tests compare strategies by SHA-256 of the
file, so both the RGB -> YUV conversion (swscale) and the encoder run single-threaded
with fixed options (threaded slices and x264's frame threads otherwise make the bytes
depend on scheduling and on the host's core count). ``+faststart`` rewrites
the file after the fact and needs a seekable real file, so we encode to a temporary file
and read it back rather than writing into BytesIO.
"""

from __future__ import annotations

import os
import tempfile
from fractions import Fraction

import av
import numpy as np

X264_OPTIONS = {"crf": "18", "preset": "medium", "threads": "1"}


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """Float frames in [0, 1] (diffusers' ``output_type="np"``) -> uint8, rounded."""
    if frames.dtype == np.uint8:
        return frames
    return (np.clip(frames, 0.0, 1.0) * 255.0).round().astype(np.uint8)


def _even(frames: np.ndarray) -> np.ndarray:
    """yuv420p needs even sides: repeat the last row/column where one is odd."""
    _, h, w, _ = frames.shape
    if h % 2 or w % 2:
        frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    return frames


def encode_mp4(frames: np.ndarray, fps: int) -> bytes:
    """Encode ``frames`` (uint8 [T, H, W, 3]) as an H.264 MP4 at ``fps``; deterministic."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 [T, H, W, 3], got {frames.dtype} {frames.shape}")
    if frames.shape[0] < 1:
        raise ValueError("frames must hold at least one frame")
    if fps < 1:
        raise ValueError(f"fps must be >= 1, got {fps}")
    frames = np.ascontiguousarray(_even(frames))
    fd, path = tempfile.mkstemp(suffix=".mp4", prefix="dloserve-")
    os.close(fd)
    try:
        with av.open(path, mode="w", format="mp4", options={"movflags": "+faststart"}) as out:
            stream = out.add_stream("libx264", rate=Fraction(int(fps), 1), options=X264_OPTIONS)
            stream.width, stream.height = frames.shape[2], frames.shape[1]
            stream.pix_fmt = "yuv420p"
            stream.codec_context.thread_count = 1
            for i, arr in enumerate(frames):
                # Convert to yuv420p ourselves, on one thread: swscale's default is
                # "auto" threads (one slice per core), which was seen to change the
                # bytes of identical 480p frames from run to run on a 32-core host.
                rgb = av.VideoFrame.from_ndarray(arr, format="rgb24")
                frame = rgb.reformat(format="yuv420p", threads=1)
                frame.pts = i
                out.mux(stream.encode(frame))
            out.mux(stream.encode(None))
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


def decode_mp4(data: bytes) -> np.ndarray:
    """Decode MP4 bytes to uint8 [T, H, W, 3] (for tests and sanity checks)."""
    import io

    with av.open(io.BytesIO(data), mode="r") as inp:
        return np.stack([f.to_ndarray(format="rgb24") for f in inp.decode(video=0)])
