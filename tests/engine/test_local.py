"""The local executor (``dloserve generate``'s) under the real dispatcher: spawned rank
processes in a real gloo group. Cancel in an AllGather group and in rank-local mode leaves
the other rank's bytes equal to resident; a rank process that dies fails its group, which
is rebuilt, and the next request is exact."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from service.config import EngineConfig, OffloadConfig, OffloadMode, ParallelConfig
from service.models.request import GenerationRequest
from service.router.build import build_dispatcher
from service.router.dispatcher import Dispatcher
from service.router.policy import DeadlinePolicy
from tests.fakes import RecordingSink

LONG = GenerationRequest(prompt="to be cancelled", seed=1, num_inference_steps=400)
BESIDE = GenerationRequest(prompt="beside it", seed=2, num_inference_steps=12)
AFTER = GenerationRequest(prompt="after", seed=3, height=48)


def running(demo_model: str, mode: OffloadMode) -> Iterator[tuple[Dispatcher, RecordingSink]]:
    parallel = ParallelConfig(dp_size=2, encoders_per_rank=0, pg_timeout_s=60, executor="local")
    spec = EngineConfig(demo_model, parallel=parallel, offload=OffloadConfig(mode))
    sink = RecordingSink()
    d = build_dispatcher(spec, sink, deadlines=DeadlinePolicy(base_s=300))
    d.start()
    try:
        yield d, sink
    finally:
        d.stop()


@pytest.fixture
def allgather(demo_model: str) -> Iterator[tuple[Dispatcher, RecordingSink]]:
    yield from running(demo_model, OffloadMode.ALLGATHER)


@pytest.fixture
def ranklocal(demo_model: str,
              caplog: pytest.LogCaptureFixture) -> Iterator[tuple[Dispatcher, RecordingSink]]:
    caplog.set_level("INFO", logger="dloserve.engine")  # before the start: its breakdown is an INFO line
    yield from running(demo_model, OffloadMode.RANK_LOCAL)


def wait_ready(d: Dispatcher) -> None:
    with d._cv:
        assert d._cv.wait_for(lambda: d.status()["state"] == "ready", 180), d.status()


def submit(d: Dispatcher, tid: str, req: GenerationRequest) -> None:
    d.submit(tid, req.compat_key(), req)


def cancel_beside(d: Dispatcher, sink: RecordingSink, resident: Any) -> None:  # noqa: ANN401
    submit(d, "long", LONG)
    submit(d, "beside", BESIDE)
    sink.until(lambda: sink.progress.get("long", 0) >= 2 and sink.progress.get("beside", 0) >= 1)
    assert d.cancel("long") == "running"
    sink.until(lambda: {"long", "beside"} <= set(sink.finished))
    long, beside = sink.finished["long"], sink.finished["beside"]
    assert long.cancelled and long.mp4 is None and sink.progress["long"] < LONG.num_inference_steps // 2
    assert beside.ok and beside.mp4 == resident.generate(BESIDE)
    submit(d, "after", AFTER)  # the cancelled rank takes work again; the group is in step
    sink.until(lambda: "after" in sink.finished)
    assert sink.finished["after"].mp4 == resident.generate(AFTER)


def test_cancel_in_an_allgather_group_leaves_the_other_rank_exact(allgather,
                                                                  resident) -> None:  # noqa: ANN001
    d, sink = allgather
    assert [g.size for g in d.executor.groups()] == [2]
    cancel_beside(d, sink, resident)


def test_cancel_in_rank_local_mode(ranklocal, resident,
                                   caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    d, sink = ranklocal
    wait_ready(d)
    assert [g.size for g in d.executor.groups()] == [1, 1]
    # the cold-start breakdown: one line per rank-local group, every stage named
    records = caplog.get_records("setup") + caplog.get_records("call")
    lines = [r.getMessage() for r in records if "ready in" in r.getMessage()]
    assert len(lines) == 2, lines
    for stage in ("process_group_s", "load_s", "load.build_s", "load.attention_check_s", "load.transformer_s",
                  "load.components_s", "encoders_s"):
        assert stage in lines[0], lines[0]
    # how the blocks compute, in the log and in the status /readyz shows: the SDPA kernel
    # torch runs for the model's heads (CPU: its flash kernel), compile and CFG batch (CPU: off)
    assert "compute: {'attention': 'flash_attention', 'compile': None, 'cfg_batch': False}" in lines[0]
    started = d.executor.status()["groups"][0]["last_start"]
    assert started["compute"]["attention"] == "flash_attention"
    cancel_beside(d, sink, resident)


@pytest.mark.e2e  # kills a rank process and waits for the rebuild
def test_a_dead_rank_process_fails_its_group_which_is_rebuilt(allgather, resident) -> None:  # noqa: ANN001
    d, sink = allgather
    d.job_retries = 0  # this test is about how the death is heard: the doomed job must end with it
    submit(d, "doomed", LONG)
    sink.until(lambda: sink.progress.get("doomed", 0) >= 1)
    (group,) = d.executor._groups.values()  # the test reaches in for the process to kill
    os.kill(group.handles[1].proc.pid, signal.SIGKILL)
    sink.until(lambda: "doomed" in sink.finished)
    err = sink.finished["doomed"].error or ""
    # the pipe's end, or rank 0's collective that lost its peer (a block gather, or a step-cache
    # decision on the control group inside the forward): whichever the executor hears first
    heard = err.startswith(("rank 1 died: process exited", "rank 0 failed: ")) or "Connection reset" in err
    assert heard, err
    submit(d, "after", AFTER)  # queued while the group is rebuilt, then exact
    sink.until(lambda: "after" in sink.finished)
    assert sink.finished["after"].mp4 == resident.generate(AFTER) and group.generation == 1
