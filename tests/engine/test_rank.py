"""The per-rank tick loop on two real gloo processes (no Ray): forward-level scheduling.

Rank 0 runs one long request. Rank 1 runs a one-forward request of another shape, and
the moment its last forward is done a driver thread gives it a third request, of a third
shape: it starts while rank 0's request is still running. Both ranks make the same
number of ticks (the same gathers), and every MP4 equals the resident reference.
A forward that raises on one rank (injected: CPU gives no real mid-forward failure)
fails that request only; the gathers stay in step and the next request is exact.
"""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from loadtest.ranks import run_ranks
from service.config import EngineConfig, OffloadConfig, OffloadMode
from service.engine.encoder import Encoder
from service.engine.events import Event, EventKind
from service.engine.rank import RankWorker, sticky_error
from service.engine.start import control_group
from service.models.pipeline import PipelineRunner
from service.models.request import GenerationRequest
from tests.ranks import collect

LONG = GenerationRequest(prompt="a long one", seed=1, num_inference_steps=60)  # 120 forwards
SHORT = GenerationRequest(prompt="short", seed=2, width=48, num_frames=9, num_inference_steps=1,
                          guidance_scale=1.0)  # 1 forward, CFG off
NEXT = GenerationRequest(prompt="next", seed=3, height=16, num_inference_steps=2)  # 4 forwards
BOOM = GenerationRequest(prompt="boom", seed=4, num_inference_steps=2)
STOPPED = GenerationRequest(prompt="to be cancelled", seed=5, num_inference_steps=400)  # 800 forwards
MID = GenerationRequest(prompt="beside it", seed=6, num_inference_steps=20)  # 40 forwards


def _scenario(rank: int, world: int, model: str) -> dict:
    settings = EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER))
    runner = PipelineRunner.load(model, "cpu", config=settings, group=dist.group.WORLD)
    worker = RankWorker(runner, rank, world, control_group(world), Encoder(1), head_wait_s=5.0)
    try:
        if rank == 0:
            worker.assign("long", LONG)
            want, hook = {"long"}, None
        else:
            worker.assign("short", SHORT)
            want = {"short", "next"}

            def hook(e: Event) -> None:  # the driver: a freed rank gets the next request
                if e.kind is EventKind.FORWARDS_DONE and e.job_id == "short":
                    worker.assign("next", NEXT)

        out: dict = {}
        t = threading.Thread(target=lambda: out.update(collect(worker, want, hook)))
        t.start()
        served = worker.serve()
        t.join(timeout=120)
        first = {"log": list(worker.tick_log), "served": served, "events": out}

        # Second round: rank 0's request raises inside block 1 of its second forward.
        worker.tick_log.clear()
        if rank == 0:
            block = runner.transformer.blocks[1]
            calls = {"n": 0}
            original = block.forward

            def flaky(*a, **k):  # noqa: ANN002, ANN003, ANN202
                calls["n"] += 1
                if calls["n"] == 2:
                    raise RuntimeError("injected failure in block 1")
                return original(*a, **k)

            block.forward = flaky
            worker.assign("boom", BOOM)
            want = {"boom"}
        else:
            worker.assign("fine", NEXT)
            want = {"fine"}
        out2: dict = {}
        t = threading.Thread(target=lambda: out2.update(collect(worker, want)))
        t.start()
        worker.serve()
        t.join(timeout=120)
        if rank == 0:
            block.forward = original
            worker.assign("after", BOOM)
            want = {"after"}
        else:
            want = set()
        out3: dict = {}
        t = threading.Thread(target=lambda: out3.update(collect(worker, want)))
        t.start()
        worker.serve()
        t.join(timeout=120)

        # Fourth round: rank 0's long request is cancelled at step 3 while rank 1's runs on.
        ticks0 = worker.ticks
        if rank == 0:
            worker.assign("stopped", STOPPED)

            def cancel(e: Event) -> None:
                if e.kind is EventKind.STEP and e.preview is None and e.job_id == "stopped" and e.step == 3:
                    assert worker.cancel("stopped")

            want, hook = {"stopped"}, cancel
        else:
            worker.assign("beside", MID)
            want, hook = {"beside"}, None
        out4: dict = {}
        t = threading.Thread(target=lambda: out4.update(collect(worker, want, hook)))
        t.start()
        worker.serve()
        t.join(timeout=120)
        return {**first, "events2": out2, "events3": out3, "events4": out4, "status": worker.status(),
                "round4_ticks": worker.ticks - ticks0, "round4_forwards": list(worker.tick_log)}
    finally:
        worker.close()
        runner.close()


@pytest.fixture(scope="module")
def ranks(demo_model: str) -> list[dict]:
    return run_ranks(_scenario, 2, demo_model, timeout=480)


def mp4(ev: dict, job: str) -> bytes:
    fin = ev[job][EventKind.FINISHED]
    assert fin.error is None, fin.error
    return fin.mp4


def test_a_freed_rank_starts_the_next_request_at_the_next_forward(ranks: list[dict],
                                                                  resident) -> None:  # noqa: ANN001
    r0, r1 = ranks
    assert len(r0["log"]) == len(r1["log"])  # same ticks: same gathers, in the same order
    long_ticks = [i for i, j in enumerate(r0["log"]) if j == "long"]
    next_ticks = [i for i, j in enumerate(r1["log"]) if j == "next"]
    assert len(long_ticks) == LONG.forwards() and len(next_ticks) == NEXT.forwards()
    assert r1["log"].count("short") == 1
    assert next_ticks[0] < long_ticks[-1]  # it joined while rank 0 was still running
    assert next_ticks == list(range(next_ticks[0], next_ticks[0] + len(next_ticks)))  # every tick
    for r in (r0, r1):  # three shapes, two step counts, CFG on and off: one group
        assert {j for j in r["log"] if j} <= {"long", "short", "next"}
    assert mp4(r0["events"], "long") == resident.generate(LONG)
    assert mp4(r1["events"], "short") == resident.generate(SHORT)
    assert mp4(r1["events"], "next") == resident.generate(NEXT)


def test_a_forward_that_raises_fails_only_its_request(ranks: list[dict], resident) -> None:  # noqa: ANN001
    r0, r1 = ranks
    err = r0["events2"]["boom"][EventKind.FINISHED].error
    assert err is not None and "injected failure in block 1" in err
    assert mp4(r1["events2"], "fine") == resident.generate(NEXT)
    assert mp4(r0["events3"], "after") == resident.generate(BOOM)
    assert r0["status"]["ticks"] == r1["status"]["ticks"]


def test_a_cancelled_request_stops_at_a_forward_and_the_other_rank_goes_on(ranks: list[dict],
                                                                             resident) -> None:  # noqa: ANN001
    r0, r1 = ranks
    fin = r0["events4"]["stopped"][EventKind.FINISHED]
    assert fin.cancelled and fin.mp4 is None
    stopped_forwards = r0["round4_forwards"].count("stopped")
    assert 6 <= stopped_forwards < STOPPED.forwards() // 2  # stopped soon after step 3 (2 forwards a step)
    assert mp4(r1["events4"], "beside") == resident.generate(MID)  # its bytes unchanged
    assert r0["round4_ticks"] == r1["round4_ticks"]  # the cancelled rank kept the group in step
    assert r0["status"]["phase"] == "idle" and r0["status"]["failed"] is None


def test_sticky_errors_take_the_rank_out() -> None:
    assert sticky_error(dist.DistBackendError("NCCL communicator was aborted"))
    assert sticky_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not sticky_error(RuntimeError("injected failure in block 1"))
    assert not sticky_error(ValueError("CUDA error: in a value error is not from the device"))
