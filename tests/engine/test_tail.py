"""A request's tail on a real rank (the demo model, CPU): the VAE's chunks go to an encoder
process as they are decoded, the MP4 is today's, and every way a tail can go wrong ends the
request with a reason.

A slow encode is made real, not timed: the encoder process is stopped (SIGSTOP) while the
rank works, and the proof that the pipeline thread did not wait is the order of events
(the next request's forwards end before the first request's MP4) and the rank's counters.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from service.engine.encoder import Encoder
from service.engine.events import Event, EventKind
from service.engine.rank import Phase, RankWorker
from service.models.request import GenerationRequest
from service.models.video import encode_mp4

A = GenerationRequest(prompt="a red square", seed=1, num_frames=9, num_inference_steps=2)
B = GenerationRequest(prompt="a blue circle", seed=2, num_frames=13, num_inference_steps=1)


class Driver:
    """One rank and everything it said, in order."""

    def __init__(self, runner, encoder: Encoder) -> None:  # noqa: ANN001
        self.worker = RankWorker(runner, encoder=encoder)
        self.events: list[Event] = []
        self._cv = threading.Condition()
        self._stop = False
        self._t = threading.Thread(target=self._pump, daemon=True)
        self._t.start()

    def _pump(self) -> None:
        while not self._stop:
            got = self.worker.events(0.2)
            with self._cv:
                self.events.extend(got)
                self._cv.notify_all()

    def run(self, *jobs: tuple[str, GenerationRequest]) -> None:
        for job_id, req in jobs:
            self.worker.assign(job_id, req)
        self.worker.serve()

    def finished(self, job_id: str, timeout: float = 300) -> Event:
        with self._cv:
            assert self._cv.wait_for(lambda: self._find(EventKind.FINISHED, job_id) is not None, timeout)
            return self._find(EventKind.FINISHED, job_id)  # type: ignore[return-value]

    def _find(self, kind: EventKind, job_id: str) -> Event | None:
        return next((e for e in self.events if e.kind is kind and e.job_id == job_id), None)

    def index(self, kind: EventKind, job_id: str) -> int:
        with self._cv:
            return next(i for i, e in enumerate(self.events) if e.kind is kind and e.job_id == job_id)

    def wait_idle(self, timeout: float = 300) -> dict:
        """Until the pipeline thread has left every request (the encoder may still work)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            st = self.worker.status()
            if st["phase"] == Phase.IDLE.value and st["current"] is None and not st["inbox"]:
                return st
            time.sleep(0.05)
        raise AssertionError(f"the pipeline thread did not get idle: {self.worker.status()}")

    def close(self) -> None:
        self._stop = True
        self.worker.close()
        self._t.join(5)


@contextmanager
def driven(runner, encoder: Encoder) -> Iterator[Driver]:  # noqa: ANN001
    d = Driver(runner, encoder)
    try:
        yield d
    finally:
        d.close()


@contextmanager
def stopped(encoder: Encoder) -> Iterator[int]:
    """The (one) encoder process stopped: every encode waits until the block ends."""
    encoder.wait_warm()
    (pid,) = encoder.pids()
    os.kill(pid, signal.SIGSTOP)
    try:
        yield pid
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def want(resident) -> dict[str, bytes]:  # noqa: ANN001
    return {"a": encode_mp4(resident.frames(A), A.fps), "b": encode_mp4(resident.frames(B), B.fps)}


@pytest.mark.parametrize("overlap", [True, False])
def test_the_streamed_mp4_is_todays(resident, want: dict[str, bytes], overlap: bool) -> None:  # noqa: ANN001
    """Chunks streamed while decoding (or the whole clip after it: the baseline) give the bytes
    of encode_mp4 on the whole clip, same frames, same thread count."""
    with driven(resident, Encoder(1, overlap=overlap)) as d:
        d.run(("a", A), ("b", B))
        got = {j: d.finished(j) for j in ("a", "b")}
    assert {j: e.mp4 for j, e in got.items()} == want
    assert all(e.error is None and "encode_s" in e.timings for e in got.values())


def test_the_pipeline_thread_does_not_wait_for_a_slow_encode(resident, want: dict[str, bytes]) -> None:  # noqa: ANN001
    enc = Encoder(1)
    with driven(resident, enc) as d:
        with stopped(enc):
            d.run(("a", A), ("b", B))
            st = d.wait_idle()
            # Both requests decoded and handed off while x264 could not run at all.
            assert st["encoding"] == 2 and enc.inflight == 2
            assert d.index(EventKind.FORWARDS_DONE, "b") >= 0
            assert all(e.kind is not EventKind.FINISHED for e in d.events)
        a, b = d.finished("a"), d.finished("b")
        assert d.index(EventKind.FORWARDS_DONE, "b") < d.index(EventKind.FINISHED, "a")
    assert (a.mp4, b.mp4) == (want["a"], want["b"])
    assert enc.waits == 0  # the frames fit the memory bound: add never waited


def test_a_killed_encoder_fails_its_request_and_the_next_is_exact(resident, want: dict[str, bytes]) -> None:  # noqa: ANN001
    enc = Encoder(1)
    with driven(resident, enc) as d:
        with stopped(enc) as pid:
            d.run(("a", A))
            d.wait_idle()
            os.kill(pid, signal.SIGKILL)
        a = d.finished("a")
        d.run(("b", B))
        b = d.finished("b")
    assert a.mp4 is None and not a.cancelled and "MP4 encoder process died (exit code -9)" in a.error
    assert b.mp4 == want["b"] and enc.died == 1 and enc.inflight == 0


@contextmanager
def on_decoder_call(runner, n: int, action) -> Iterator[None]:  # noqa: ANN001
    """``action()`` as the VAE decoder starts its ``n``-th chunk (a cancel or an error that
    lands mid-decode, where it would otherwise race the decode)."""
    calls = [0]

    def hook(module: torch.nn.Module, args: object) -> None:
        calls[0] += 1
        if calls[0] == n:
            action()

    h = runner.adapter._parts["vae"].decoder.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        h.remove()


def test_a_cancel_mid_decode_ends_the_request_cancelled(resident, want: dict[str, bytes]) -> None:  # noqa: ANN001
    enc = Encoder(1)
    with driven(resident, enc) as d:
        with on_decoder_call(resident, 2, lambda: d.worker.cancel("a")):  # after chunk 1 was sent
            d.run(("a", A))
            a = d.finished("a")
        d.run(("b", B))
        b = d.finished("b")
    assert a.cancelled and a.error == "cancelled" and a.mp4 is None
    assert b.mp4 == want["b"] and enc.inflight == 0


def test_a_decode_error_mid_clip_fails_the_request(resident, want: dict[str, bytes]) -> None:  # noqa: ANN001
    def boom() -> None:
        raise RuntimeError("decoder broke")

    enc = Encoder(1)
    with driven(resident, enc) as d:
        with on_decoder_call(resident, 3, boom):
            d.run(("a", A))
            a = d.finished("a")
        d.run(("b", B))
        b = d.finished("b")
    assert a.error == "RuntimeError: decoder broke" and a.mp4 is None and not a.cancelled
    assert b.mp4 == want["b"] and enc.inflight == 0


def test_a_cancel_while_encoding_drops_the_encode(resident, want: dict[str, bytes]) -> None:  # noqa: ANN001
    enc = Encoder(1)
    with driven(resident, enc) as d:
        with stopped(enc):
            d.run(("a", A))
            d.wait_idle()
            assert d.worker.cancel("a") is True
            a = d.finished("a")
        d.run(("b", B))
        b = d.finished("b")
        assert d.worker.cancel("b") is False  # its MP4 is done
    assert a.cancelled and a.mp4 is None and b.mp4 == want["b"] and enc.inflight == 0


def test_the_memory_bound_holds_back_the_decode(resident, want: dict[str, bytes]) -> None:  # noqa: ANN001
    """Frames waiting for an encoder are bounded: with room for none, the next clip's second
    chunk waits (its first is over the bound: the one process still holds the first clip),
    and it goes on once x264 takes them; the bytes do not change."""
    enc = Encoder(1, max_buffered=0)
    with driven(resident, enc) as d:
        with stopped(enc):
            d.worker.assign("a", A)
            d.worker.assign("b", B)
            t = threading.Thread(target=d.worker.serve)
            t.start()
            end = time.monotonic() + 300
            while enc.waits == 0 and time.monotonic() < end:
                time.sleep(0.05)
            st = d.worker.status()
            assert enc.waits == 1 and st["phase"] == Phase.TAIL.value and st["current"] == "b"
        t.join(300)
        a, b = d.finished("a"), d.finished("b")
    assert (a.mp4, b.mp4) == (want["a"], want["b"])


def test_chunked_frames_sum_to_the_clip(resident) -> None:  # noqa: ANN001
    chunks: list[np.ndarray] = []
    resident.frames(B, on_frames=chunks.append)
    assert [len(c) for c in chunks] == [1, 4, 4, 4]
