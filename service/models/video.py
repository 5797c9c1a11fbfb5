"""H.264 MP4 encoding with PyAV: the bytes are a function of the frames and fps alone.

Same frames -> same bytes is what lets the tests compare strategies by SHA-256 of the
file. Three things stood in the way:

- Threads. swscale's RGB -> YUV conversion and x264 both run single-threaded with fixed
  options (threaded slices and x264's frame threads make the bytes depend on scheduling
  and on the host's core count).
- x264's AVX-512 macroblock tree read memory it never wrote. The lookahead's
  ``mbtree_propagate_list_internal_avx512`` (x264 common/x86/mc-a2.asm) handles 8
  macroblocks per loop iteration and has no tail: when a frame's width in macroblocks is
  not a multiple of 8 (96, 832 or 480 pixels wide, say) the last iteration reads
  propagate amounts past the row's end, from a scratch buffer x264 allocated but never
  filled, and adds them into real macroblocks' propagate costs. Those become QP offsets,
  so whatever an earlier pipeline run left in the heap changed the bitstream (issue 9:
  four encodes of one set of frames gave four files). The SSE/AVX2 versions stop at the
  row's end. So we ask x264 which instruction sets the CPU has and hand it that set
  without AVX-512; the encoder never enters that routine, and keeps its macroblock tree
  (turning the tree off instead made a smooth synthetic 480p clip 1.8x larger at the
  same PSNR). Where
  the library cannot be asked, the tree is turned off instead, which is also exact.
- ``+faststart`` rewrites the file after the fact and needs a seekable real file, so we
  encode to a temporary file and read it back rather than writing into BytesIO.

The bytes are the same run to run and process to process on one machine; across CPUs
with different instruction sets x264's SIMD variants may round differently.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import tempfile
from fractions import Fraction

import av
import numpy as np

log = logging.getLogger("dloserve.video")

X264_BASE = {"crf": "18", "preset": "medium", "threads": "1"}
X264_CPU_AVX512 = 1 << 16  # x264.h; stable since x264 gained AVX-512 (build 152)


def x264_options() -> dict[str, str]:
    """The codec options every encode uses (the CPU mask is read once per process)."""
    return {**X264_BASE, "x264-params": _x264_params()}


@functools.cache
def _x264_params() -> str:
    mask = _x264_cpu_flags()
    if mask is None:
        log.warning("cannot ask libx264 for its CPU flags: encoding without the macroblock "
                    "tree so the bytes stay a function of the frames")
        return "mbtree=0"
    return f"asm={mask & ~X264_CPU_AVX512}"


def _x264_cpu_flags() -> int | None:
    """What ``x264_cpu_detect`` of the libx264 PyAV loaded says the CPU has, or None."""
    path = _loaded_library("libx264") or ctypes.util.find_library("x264")
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        detect = lib.x264_cpu_detect
    except (OSError, AttributeError):
        return None
    detect.restype = ctypes.c_uint32
    detect.argtypes = []
    return int(detect())


def _loaded_library(stem: str) -> str | None:
    """The path of an already mapped shared library whose file name starts with ``stem``."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith(stem):
                    return parts[5].strip()
    except OSError:
        pass
    return None


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
            stream = out.add_stream("libx264", rate=Fraction(int(fps), 1), options=x264_options())
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
