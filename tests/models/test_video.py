"""MP4 bytes are a function of the frames alone: not of the heap, not of what ran before,
not of the CPUs the process may use or of how its threads were scheduled.

The frames here are 96 and 480 pixels wide (6 and 30 macroblocks): x264's AVX-512
macroblock-tree code read memory it never wrote at such widths (see
service/models/video.py), so before that fix these tests failed on any CPU with AVX-512.
``MALLOC_PERTURB_`` makes glibc fill every fresh allocation with a chosen byte: a reader
of uninitialised heap then sees different values per run, where it would otherwise see
whatever happened to be there. x264 now runs ``X264_THREADS`` frame threads: its output
depends on the count, so the count must not follow the host (x264's "auto" counts the
CPUs in the affinity mask; a process pinned to one CPU would then get other bytes).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from service.models.pipeline import PipelineRunner
from service.models.request import GenerationRequest
from service.models.video import X264_THREADS, Mp4Writer, encode_mp4, x264_options, x264_settings

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


# One process of the concurrent test: pinned to a CPU or not, a heap left holding its own
# byte pattern by earlier allocations, then the service's encode of every input file.
CONCURRENT = """
import hashlib, json, os, sys
import numpy as np
cpu, fill = int(sys.argv[1]), int(sys.argv[2])
if cpu >= 0:
    os.sched_setaffinity(0, {cpu})
junk = [bytearray([fill]) * (1 << k) for k in range(6, 24)]
del junk[::2]
from service.models.video import encode_mp4, x264_settings
out = {}
for path in sys.argv[3:]:
    data = encode_mp4(np.load(path), 8)
    s = x264_settings(data)
    out[path] = [hashlib.sha256(data).hexdigest(), s.get("threads"), s.get("sliced_threads")]
print(json.dumps(out))
"""
BUSY = "import time\nend = time.monotonic() + 600\nwhile time.monotonic() < end:\n    pass\n"


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


def _panning(t: int, h: int, w: int) -> np.ndarray:
    """A smooth field moving a few pixels per frame: motion search and the macroblock tree
    have real work, across frames the frame threads encode at once."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    out = [np.stack([128 + 60 * np.sin((x + 3 * i) / 17) + 40 * np.cos((y + i) / 11),
                     128 + 80 * np.sin((x + y + 2 * i) / 29),
                     128 + 90 * np.cos((x - 2 * i) / 23)], -1) for i in range(t)]
    return np.clip(np.array(out), 0, 255).astype(np.uint8)


def test_one_file_across_processes_heaps_cpus_and_load(frames_file: Path, tmp_path: Path) -> None:
    """Five processes encode at once, beside a busy one: different heap contents
    (``MALLOC_PERTURB_``, large buffers from the heap, earlier allocations), one CPU or all
    of them, preempted threads. One file per input, equal to this process's, and x264 says
    it ran ``X264_THREADS`` frame threads in every one of them."""
    panning = tmp_path / "panning.npy"
    np.save(panning, _panning(17, 272, 480))
    inputs = [str(frames_file), str(panning)]
    cpus = sorted(os.sched_getaffinity(0))
    configs = [(None, -1, False), (1, cpus[0], True), (85, -1, False), (170, cpus[-1], True), (255, -1, True)]
    busy = subprocess.Popen([sys.executable, "-c", BUSY])
    procs = []
    try:
        for perturb, cpu, heap_mmap in configs:
            env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
            if perturb is not None:
                env["MALLOC_PERTURB_"] = str(perturb)
            if heap_mmap:
                env["MALLOC_MMAP_THRESHOLD_"] = str(32 * 2**20)
            procs.append(subprocess.Popen(
                [sys.executable, "-c", CONCURRENT, str(cpu), str((perturb or 0) ^ 0x5A), *inputs],
                env=env, stdout=subprocess.PIPE, text=True))
        outs = [json.loads(p.communicate(timeout=600)[0]) for p in procs]
    finally:
        for p in [*procs, busy]:
            p.kill()
            p.wait()
    here = {path: sha(encode_mp4(np.load(path), 8)) for path in inputs}
    for path in inputs:
        assert {o[path][0] for o in outs} == {here[path]}, (path, [o[path] for o in outs])
        assert {(o[path][1], o[path][2]) for o in outs} == {(str(X264_THREADS), "0")}


def test_x264_threads_are_a_constant_never_auto() -> None:
    """The count, frame (not sliced) threads and x264's deterministic mode are all spelled
    out to x264 itself, so neither PyAV's defaults nor the host pick them."""
    params = dict(kv.split("=", 1) for kv in x264_options()["x264-params"].split(":"))
    assert params["threads"] == str(X264_THREADS) and X264_THREADS >= 1
    assert (params["sliced-threads"], params["non-deterministic"]) == ("0", "0")
    with pytest.raises(ValueError, match="never auto"):
        x264_options(0)


def test_frames_fed_in_chunks_give_the_same_bytes(frames: np.ndarray) -> None:
    """``Mp4Writer`` fed 1 + 4 + 4 frames (the Wan VAE's causal chunks), or any other
    split, writes the file ``encode_mp4`` writes for all frames at once."""
    whole = encode_mp4(frames, REQ.fps)
    assert x264_settings(whole)["threads"] == str(X264_THREADS)
    for sizes in ([1, 4, 4], [9], [2, 3, 4], [1] * 9):
        w = Mp4Writer(frames.shape[2], frames.shape[1], REQ.fps)
        start = 0
        for n in sizes:
            w.add(frames[start:start + n])
            start += n
        assert w.close() == whole, sizes
    assert encode_mp4(frames, REQ.fps, threads=1) != whole  # the count is part of the bytes


def test_writer_refuses_other_sizes_and_leaves_no_file(
    frames: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    w = Mp4Writer(frames.shape[2], frames.shape[1], REQ.fps)
    with pytest.raises(ValueError, match="this MP4 is"):
        w.add(frames[:, :-2])
    w.abort()
    with pytest.raises(ValueError, match="at least one frame"):
        Mp4Writer(8, 8, REQ.fps).close()
    with pytest.raises(ValueError, match="fps"):
        Mp4Writer(8, 8, 0)
    assert list(tmp_path.iterdir()) == []


def test_a_process_killed_mid_encode_leaves_no_file(tmp_path: Path) -> None:
    """A rank SIGKILLed while it encodes (the chaos tests do it; an OOM kill does) cannot clean
    up: its temp file must have no name to leave behind."""
    code = ("import os, signal, numpy as np\n"
            "from service.models.video import Mp4Writer\n"
            "w = Mp4Writer(96, 64, 8)\n"
            "w.add(np.full((9, 64, 96, 3), 100, np.uint8))\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(tmp_path)},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == -9, p.stderr
    assert list(tmp_path.iterdir()) == []


def test_x264_never_runs_its_avx512_code() -> None:
    """The encoder is told which instruction sets to use, and AVX-512 is not among them."""
    params = dict(kv.split("=", 1) for kv in x264_options()["x264-params"].split(":"))
    if "asm" in params:
        assert not int(params["asm"]) & (1 << 16)
    else:  # x264 could not be asked what the CPU has: no macroblock tree at all
        assert params["mbtree"] == "0"
