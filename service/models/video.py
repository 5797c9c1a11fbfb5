"""H.264 MP4 encoding with PyAV: the bytes are a function of the frames and fps alone.

Same frames -> same bytes is what lets the tests compare strategies by SHA-256 of the
file. Three things stood in the way:

- Threads. x264 runs ``X264_THREADS`` frame threads, a constant: its output is a function
  of its input and its options, the thread count included (x264 is deterministic for a
  given count unless ``--non-deterministic`` is set, and we set it off explicitly), so the
  count is part of the bytes' identity and never follows the host ("auto" would: x264
  counts the CPUs in the process's affinity). Frame threads, not sliced threads: sliced
  threads cut every frame into one slice per thread, which buys latency a file does not
  need and costs compression (a smooth 832x480x81 clip: +2%, +7%, +13% at 2, 4, 8
  slices, same CRF), and x264 stops at 7 of them for 480-row frames; a frame-threaded
  encode's busiest thread did 1/T of the work (loadtest/results/cpu-encode-threads-*).
  swscale's RGB -> YUV conversion stays on one thread (its default is "auto", one slice
  per core, which was seen to change the bytes of identical 480p frames on a 32-core host).
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
  encode to a temporary file and read it back rather than writing into BytesIO. The file
  is unlinked as soon as it is made and written through ``/proc/self/fd`` (Linux): a rank
  killed mid-encode (SIGKILL, OOM) leaves nothing in the temp folder; a named one was left
  per kill, as large as the encode had got.

The bytes are the same run to run and process to process on one machine; across CPUs
with different instruction sets x264's SIMD variants may round differently.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import re
import tempfile
from fractions import Fraction

import av
import numpy as np

log = logging.getLogger("dloserve.video")

# Frame threads per encode. A constant, never derived from the host: the bytes change
# with it (changing it changes every file). 4: on a 16-core host a 480x832x81 noise clip
# took 11.6 s on 1 thread, 4.6 on 4, 3.2 on 8 (design.md section 8; PyAV's default,
# sliced, threads), so 4 has most of the latency gain at 2.5x one thread's speed, and it
# fits a rank given 4 CPUs; the encoder pool (engine/encoder.py) runs about
# cpus // X264_THREADS encodes at once.
X264_THREADS = 4
X264_BASE = {"crf": "18", "preset": "medium"}
X264_CPU_AVX512 = 1 << 16  # x264.h; stable since x264 gained AVX-512 (build 152)


def x264_options(threads: int = X264_THREADS, base: dict[str, str] | None = None) -> dict[str, str]:
    """The codec options of every encode (the CPU mask is read once per process); ``base``
    (preset and crf) is ``X264_BASE`` unless a benchmark compares others.

    Threading goes in ``x264-params`` too, which libx264 applies last, so x264 gets
    exactly these whatever PyAV's codec defaults are (its thread type is "slice").
    """
    if threads < 1:
        raise ValueError(f"x264 threads must be >= 1 (never auto), got {threads}")
    params = f"{_x264_params()}:threads={threads}:sliced-threads=0:non-deterministic=0"
    return {**(base or X264_BASE), "threads": str(threads), "x264-params": params}


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


def _check_frames(frames: np.ndarray) -> None:
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 [T, H, W, 3], got {frames.dtype} {frames.shape}")


class Mp4Writer:
    """One MP4 encode fed frames as they come (``add``), finished by ``close``.

    The bytes are those of ``encode_mp4`` on all the frames at once, however they were
    split: x264 sees the same frames in the same order with the same options.
    """

    def __init__(self, width: int, height: int, fps: int, *, threads: int = X264_THREADS,
                 base: dict[str, str] | None = None) -> None:
        if fps < 1:
            raise ValueError(f"fps must be >= 1, got {fps}")
        if width < 1 or height < 1:
            raise ValueError(f"frame size must be positive, got {width}x{height}")
        options = x264_options(threads, base)
        self.size = (height, width)
        self.frames = 0  # frames given to x264
        self.finished = 0  # frames x264 has given back encoded (it holds its lookahead)
        self._fd, path = tempfile.mkstemp(suffix=".mp4", prefix="dloserve-")
        self._path = path
        if os.path.isdir("/proc/self/fd"):  # nameless from here on: nothing outlives the process
            os.unlink(path)
            self._path = f"/proc/self/fd/{self._fd}"
        try:
            self._out = av.open(self._path, mode="w", format="mp4", options={"movflags": "+faststart"})
            self._stream = self._out.add_stream("libx264", rate=Fraction(int(fps), 1), options=options)
            self._stream.width, self._stream.height = width + width % 2, height + height % 2
            self._stream.pix_fmt = "yuv420p"
            self._stream.codec_context.thread_count = threads
            self._stream.codec_context.thread_type = "FRAME"
        except BaseException:
            self._release()
            raise

    def add(self, frames: np.ndarray) -> None:
        """Encode uint8 [t, H, W, 3] frames next (x264 holds some back until ``close``)."""
        _check_frames(frames)
        if frames.shape[1:3] != self.size:
            raise ValueError(f"frames are {frames.shape[2]}x{frames.shape[1]}, this MP4 is "
                             f"{self.size[1]}x{self.size[0]}")
        for arr in np.ascontiguousarray(_even(frames)):
            # Convert to yuv420p ourselves, on one thread (see the module's notes).
            rgb = av.VideoFrame.from_ndarray(arr, format="rgb24")
            frame = rgb.reformat(format="yuv420p", threads=1)
            frame.pts = self.frames
            self.frames += 1
            packets = self._stream.encode(frame)
            self.finished += len(packets)
            self._out.mux(packets)

    def close(self) -> bytes:
        """Flush x264, finish the file (``+faststart``) and return its bytes."""
        try:
            if self.frames < 1:
                raise ValueError("frames must hold at least one frame")
            self._out.mux(self._stream.encode(None))
            self._out.close()
            with open(self._path, "rb") as f:
                return f.read()
        finally:
            self.abort()

    def abort(self) -> None:
        """Drop the encode (safe to call more than once, and after ``close``)."""
        try:
            self._out.close()
        except Exception:  # noqa: BLE001 - already closed, or failed mid-write: nothing to keep
            pass
        self._release()

    def _release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if not self._path.startswith("/proc/") and os.path.exists(self._path):
            os.unlink(self._path)


def encode_mp4(frames: np.ndarray, fps: int, *, threads: int = X264_THREADS,
               base: dict[str, str] | None = None) -> bytes:
    """Encode ``frames`` (uint8 [T, H, W, 3]) as an H.264 MP4 at ``fps``; deterministic.

    ``threads`` and ``base`` are for benchmarks: the service always encodes with
    ``X264_THREADS`` and ``X264_BASE``, since others give other (equally deterministic) bytes.
    """
    _check_frames(frames)
    if frames.shape[0] < 1:
        raise ValueError("frames must hold at least one frame")
    writer = Mp4Writer(frames.shape[2], frames.shape[1], fps, threads=threads, base=base)
    try:
        writer.add(frames)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def x264_settings(data: bytes) -> dict[str, str]:
    """The options x264 says it ran with, from the SEI it writes into the stream.

    How a test or a benchmark checks what the encoder really did (threads, slices),
    rather than what it was asked for.
    """
    m = re.search(rb"x264 - core \d+.*? - options: ([ -~]*)", data)
    if m is None:
        return {}
    return dict(kv.split("=", 1) for kv in m.group(1).decode().split() if "=" in kv)


def decode_mp4(data: bytes) -> np.ndarray:
    """Decode MP4 bytes to uint8 [T, H, W, 3] (for tests and sanity checks)."""
    import io

    with av.open(io.BytesIO(data), mode="r") as inp:
        return np.stack([f.to_ndarray(format="rgb24") for f in inp.decode(video=0)])
