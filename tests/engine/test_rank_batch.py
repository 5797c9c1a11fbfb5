"""Batched requests on one real rank: the trained demo model streamed through the offload
(AllGather, DP1), a real MP4 encoder process. Requests of one batch key share each forward
(the rank's forward counter proves it), each with its own seed and step count; each ends
with its own frames, the same bytes on a second run of the same composition and within
45 dB PSNR of its run alone; other shapes never share; cancel leaves the others going;
``--max-batch-size 1`` and a request alone give today's bytes."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest

from service.config import EngineConfig, OffloadConfig, OffloadMode, SchedulerConfig
from service.engine.encoder import Encoder
from service.engine.events import Event, EventKind
from service.engine.rank import RankWorker
from service.models.pipeline import PipelineRunner
from service.models.registry import request_defaults, resolve_model
from service.models.request import GenerationRequest

MODEL = resolve_model(None)
BASE = replace(GenerationRequest(prompt="-", **request_defaults(MODEL)), num_inference_steps=3)
A = replace(BASE, prompt="a red circle moving right", seed=1)  # 6 forwards (CFG, two calls a step)
B = replace(BASE, prompt="a blue square moving down", seed=2, num_inference_steps=2)  # 4
C = replace(BASE, prompt="a green triangle", seed=3)  # 6
WIDE = replace(A, width=BASE.width * 2, seed=4)  # another shape: another batch key


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


class Rank:
    """One rank of the demo model under DLO with ``cap`` requests per forward; every FINISHED
    event and the frames each request handed its encoder."""

    def __init__(self, cap: int | str) -> None:
        config = EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER),
                              scheduler=SchedulerConfig(max_batch_size=cap))
        self.runner = PipelineRunner.load(MODEL, "cpu", config=config)
        self.worker = RankWorker(self.runner, encoder=Encoder(1), head_wait_s=60.0)
        self.frames: dict[str, np.ndarray] = {}
        self._made: list[tuple[GenerationRequest, np.ndarray]] = []  # what the runner returned, in order
        self.hold: dict[GenerationRequest, threading.Event] = {}  # its decode waits at its first chunk
        frames = self.runner.frames

        def keep(req: GenerationRequest, on_step=None, on_latents=None, on_frames=None,  # noqa: ANN001
                 **kw) -> np.ndarray | None:  # noqa: ANN003
            chunks: list[np.ndarray] = []

            def take(f: np.ndarray) -> None:  # the decoded chunks on their way to the encoder
                if req in self.hold:
                    assert self.hold[req].wait(120), "the test never let the decode go on"
                chunks.append(f.copy())
                if on_frames is not None:
                    on_frames(f)

            out = frames(req, on_step, on_latents, take, **kw)
            self._made.append((req, np.concatenate(chunks)))
            return out

        self.runner.frames = keep  # type: ignore[method-assign]

    def run(self, jobs: dict[str, GenerationRequest], on_event=None) -> dict[str, Event]:  # noqa: ANN001
        """Assign ``jobs`` at once, tick until idle; FINISHED by job; forwards this round."""
        forwards = self.worker.forwards
        done: dict[str, Event] = {}

        def pump() -> None:
            while set(jobs) - set(done):
                for e in self.worker.events(0.5):
                    if on_event is not None:
                        on_event(e)
                    if e.kind is EventKind.FINISHED:
                        done[e.job_id] = e

        t = threading.Thread(target=pump)
        t.start()
        for job, req in jobs.items():
            self.worker.assign(job, req)
        self.worker.serve()
        t.join(timeout=300)
        self.forwards = self.worker.forwards - forwards
        for job, req in jobs.items():  # each request of a round is distinct (seed, prompt, shape)
            made = [f for r, f in self._made if r == req]
            if made:  # (a cancelled one has none)
                self.frames[job] = made[0]
        self._made.clear()
        return done

    def close(self) -> None:
        self.worker.close()
        self.runner.close()


@pytest.fixture(scope="module")
def alone() -> dict[str, np.ndarray]:
    """Each request run alone through the runner: today's path, today's frames."""
    config = EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER))
    runner = PipelineRunner.load(MODEL, "cpu", config=config)
    try:
        return {k: runner.frames(r) for k, r in {"a": A, "b": B, "c": C, "wide": WIDE}.items()}
    finally:
        runner.close()


def test_one_key_shares_forwards_deterministically_and_close_to_each_run_alone(alone) -> None:  # noqa: ANN001
    rank = Rank(4)
    try:
        first = rank.run({"a": A, "b": B, "c": C})
        assert rank.forwards == 6  # not 6 + 4 + 6: every forward carried the members still going
        assert all(first[j].error is None and first[j].mp4 for j in "abc")
        assert [first[j].timings["batch_size"] for j in "abc"] == [3, 3, 3]
        frames = dict(rank.frames)
        again = rank.run({"a": A, "b": B, "c": C})  # the same composition: the same bytes
        assert rank.forwards == 6
        for j in "abc":
            assert np.array_equal(rank.frames[j], frames[j]), j
            assert again[j].mp4 == first[j].mp4, j
            assert psnr(frames[j], alone[j]) >= 45.0, (j, psnr(frames[j], alone[j]))
        assert not np.array_equal(frames["a"], frames["c"])  # each its own frames
        solo = rank.run({"a": A})  # alone on a batching rank: passed through, today's bytes
        assert np.array_equal(rank.frames["a"], alone["a"]) and solo["a"].timings["batch_size"] == 1
    finally:
        rank.close()


def test_other_shapes_never_share_and_max_batch_size_1_keeps_todays_bytes(alone) -> None:  # noqa: ANN001
    rank = Rank(4)
    try:
        rank.run({"a": A, "wide": WIDE})
        assert rank.forwards == 12  # two keys: each its own forwards
        for j in ("a", "wide"):
            assert np.array_equal(rank.frames[j], alone[j]), j
    finally:
        rank.close()
    rank = Rank(1)
    try:
        done = rank.run({"a": A, "b": B, "c": C})
        assert rank.forwards == 16
        for j in "abc":
            assert np.array_equal(rank.frames[j], alone[j]) and done[j].timings["batch_size"] == 1, j
    finally:
        rank.close()


def test_a_cancelled_member_leaves_at_the_next_forward_and_the_others_finish() -> None:
    rank = Rank(4)
    long = replace(A, num_inference_steps=40)  # 80 forwards
    cancelled = threading.Event()

    def on_event(e: Event) -> None:
        if e.kind is EventKind.STEP and e.job_id == "stop" and e.step == 2 and not cancelled.is_set():
            cancelled.set()
            assert rank.worker.cancel("stop")

    try:
        done = rank.run({"stop": long, "b": B, "c": C}, on_event)
        assert done["stop"].cancelled and done["stop"].error == "cancelled"
        assert rank.forwards < 80  # it left long before its own forwards were done
        assert all(done[j].error is None and done[j].mp4 for j in "bc"), {j: done[j].error for j in "bc"}
    finally:
        rank.close()


def test_a_member_cancelled_while_it_decodes_ends_cancelled_and_the_batch_goes_on() -> None:
    """Its forwards are done (it left the batch) and its VAE decode runs beside the others'
    forwards: a cancel still reaches it, at its next decoded chunk, and no MP4 is made."""
    rank = Rank(4)
    rank.hold[B] = threading.Event()
    answers: list[bool] = []

    def on_event(e: Event) -> None:
        if e.kind is EventKind.FORWARDS_DONE and e.job_id == "b":
            answers.append(rank.worker.cancel("b"))
            rank.hold[B].set()

    try:
        done = rank.run({"b": B, "c": C}, on_event)
        assert answers == [True]
        assert done["b"].cancelled and done["b"].error == "cancelled" and done["b"].mp4 is None
        assert done["c"].error is None and done["c"].mp4
    finally:
        rank.close()
