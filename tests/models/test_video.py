"""MP4 bytes are a function of the frames alone: not of the heap, not of what ran before.

The frames here are 96 pixels wide (6 macroblocks): x264's AVX-512 macroblock-tree code
read memory it never wrote at such widths (see service/models/video.py), so before the
fix these tests failed on any CPU with AVX-512. ``MALLOC_PERTURB_`` makes glibc fill
every fresh allocation with a chosen byte: a reader of uninitialised heap then sees
different values per run, where it would otherwise see whatever happened to be there.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from service.models.pipeline import PipelineRunner
from service.models.request import GenerationRequest
from service.models.video import encode_mp4, x264_options

REQ = GenerationRequest(prompt="a red fox runs through snow", width=96, height=64, num_frames=9,
                        num_inference_steps=3, seed=0)
OTHERS = [
    GenerationRequest(prompt=f"other request {i}", seed=i, width=w, height=h, num_frames=n)
    for i, (w, h, n) in enumerate([(32, 32, 5), (96, 64, 9), (48, 32, 5), (64, 48, 9), (112, 16, 1)])
]
ENCODE = """
import sys, numpy as np
from service.models.video import encode_mp4
sys.stdout.buffer.write(encode_mp4(np.load(sys.argv[1]), int(sys.argv[2])))
"""


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode_in_fresh_process(frames_file: Path, fps: int, perturb: int | None = None) -> bytes:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_PERTURB_"}
    if perturb is not None:
        env["MALLOC_PERTURB_"] = str(perturb)
    out = subprocess.run([sys.executable, "-c", ENCODE, str(frames_file), str(fps)], env=env,
                         capture_output=True, check=True, timeout=120)
    return out.stdout


@pytest.fixture(scope="module")
def frames(resident: PipelineRunner) -> np.ndarray:
    return resident.frames(REQ)


@pytest.fixture(scope="module")
def frames_file(frames: np.ndarray, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("frames") / "frames.npy"
    np.save(path, frames)
    return path


def test_same_frames_same_bytes_after_pipeline_runs(
    resident: PipelineRunner, frames: np.ndarray, frames_file: Path
) -> None:
    """Encode after 0..5 pipeline runs of other requests: one file, the fresh process's."""
    digests = [sha(encode_mp4(frames, REQ.fps))]
    for other in OTHERS:
        resident.frames(other)  # leaves its allocations behind in this process
        digests.append(sha(encode_mp4(frames, REQ.fps)))
    assert resident.frames(REQ).tobytes() == frames.tobytes()  # the frames themselves are stable
    fresh = sha(encode_in_fresh_process(frames_file, REQ.fps))
    assert digests == [fresh] * len(digests)


def test_bytes_do_not_depend_on_heap_contents(frames_file: Path) -> None:
    """Fresh processes whose malloc hands out blocks filled with 0x01, 0x55 or 0xaa agree."""
    outs = {p: sha(encode_in_fresh_process(frames_file, REQ.fps, p)) for p in (1, 85, 170)}
    assert len(set(outs.values())) == 1, outs


def test_x264_never_runs_its_avx512_code() -> None:
    """The encoder is told which instruction sets to use, and AVX-512 is not among them."""
    params = dict(kv.split("=", 1) for kv in x264_options()["x264-params"].split(":"))
    if "asm" in params:
        assert not int(params["asm"]) & (1 << 16)
    else:  # x264 could not be asked what the CPU has: no macroblock tree at all
        assert params["mbtree"] == "0"
