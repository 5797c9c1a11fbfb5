"""Reruns that go on from the last step (issues 35, 48), on real Ray rank actors (gloo; the
"tiny" demo preset, named: its scheduler is UniPC, Wan's published one, which keeps history
between steps; "wan22-t2v-tiny" for two experts):

- DP1 (rank-local: one rank, its own shards): the only rank's actor is killed at step
  k >= 2 of 40; the group is rebuilt and the request completes, resumed from a step >= 1,
  with the bytes of an uninterrupted run (the resident reference, what ``dloserve generate``
  writes);
- DP2 AllGather: one rank killed mid-request stops both ranks' requests; both (the suspect
  and the bystander, one of them with a First Block Cache on) go on from their own last
  steps on the rebuilt group, bytes equal; the same on Wan2.2's two experts;
- DP1: a killed rank's request with a step cache on, and one on two experts, likewise;
- DP1, no death: a request paused by ``Dispatcher.preempt`` at a forward boundary goes on
  from its last step on the same rank, bytes equal;
- DP1, priorities: a priority-0 request sent while a priority-5 one runs on the only rank
  pauses it (the dispatcher's own policy), completes first, and the paused one completes
  later from its step, bytes equal.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray

from service.config import EngineConfig, OffloadConfig, OffloadMode, ParallelConfig
from service.config.cache import CacheSpec
from service.models.demo import ensure_demo_model
from service.models.pipeline import PipelineRunner
from service.models.request import GenerationRequest
from service.router.dispatcher import Dispatcher
from service.router.policy import DeadlinePolicy
from tests.engine.test_ray_executor import SharedEngine, running, submit, wait_ready
from tests.fakes import RecordingSink

pytestmark = pytest.mark.e2e  # kills real rank actors and waits for the rebuilds


FBC = CacheSpec("first_block", threshold=0.2)


@pytest.fixture(scope="module")
def unipc_model() -> str:
    return str(ensure_demo_model("tiny"))


@pytest.fixture(scope="module")
def experts_model() -> str:
    return str(ensure_demo_model("wan22-t2v-tiny"))


@pytest.fixture(scope="module")
def reference(unipc_model: str) -> Iterator[PipelineRunner]:
    runner = PipelineRunner.load(unipc_model, "cpu", config=None)
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def experts_reference(experts_model: str) -> Iterator[PipelineRunner]:
    runner = PipelineRunner.load(experts_model, "cpu", config=None)
    yield runner
    runner.close()


def spec(model: str, dp: int, mode: OffloadMode) -> EngineConfig:
    return EngineConfig(model, parallel=ParallelConfig(dp_size=dp, cpus_per_rank=0.5, pg_timeout_s=60,
                                                       encoders_per_rank=0), offload=OffloadConfig(mode))


@pytest.fixture(scope="module")
def dp1_engine(ray_cluster: dict, unipc_model: str) -> Iterator[SharedEngine]:
    engine = SharedEngine(spec(unipc_model, 1, OffloadMode.RANK_LOCAL), deadlines=DeadlinePolicy(base_s=300))
    yield engine
    engine.stop()


@pytest.fixture
def dp1(dp1_engine: SharedEngine) -> tuple[Dispatcher, RecordingSink]:
    """The module's one DP1 dispatcher (a start each cost ~10 s), ready, its sink cleared: each
    test's jobs have ended before the next begins, and a death in one is rebuilt before it."""
    d, sink = dp1_engine.get()
    wait_ready(d)
    sink.reset()
    return d, sink


@pytest.fixture
def dp2(ray_cluster: dict, unipc_model: str,
        dp1_engine: SharedEngine) -> Iterator[tuple[Dispatcher, RecordingSink]]:
    dp1_engine.stop()  # its CPU: beside the session's Serve app, the DP2 group would not fit
    yield from running(spec(unipc_model, 2, OffloadMode.ALLGATHER), deadlines=DeadlinePolicy(base_s=300))


@pytest.fixture(params=[1, 2], ids=["dp1", "dp2"])
def experts(request: pytest.FixtureRequest, ray_cluster: dict, experts_model: str,
            dp1_engine: SharedEngine) -> Iterator[tuple[Dispatcher, RecordingSink]]:
    dp1_engine.stop()  # (as dp2)
    mode = OffloadMode.ALLGATHER if request.param == 2 else OffloadMode.RANK_LOCAL
    yield from running(spec(experts_model, request.param, mode), deadlines=DeadlinePolicy(base_s=300))


def killed_then_resumed(d: Dispatcher, sink: RecordingSink, reference: PipelineRunner,
                        reqs: dict[str, GenerationRequest], victim: int) -> None:
    """Kill rank ``victim`` once every request made 2 steps; each must end resumed and exact."""
    for job, req in reqs.items():
        submit(d, job, req)
    for job in reqs:
        sink.wait_progress(job, 2)
    (group,) = d.executor._groups.values()
    generation = group.generation  # the DP1 dispatcher is the module's: an earlier test may have rebuilt it
    ray.kill(group.handles[victim])
    outs = sink.wait(list(reqs), timeout=400)
    assert sorted(i for i, _ in sink.requeued) == sorted(reqs)
    for (job, req), out in zip(reqs.items(), outs, strict=True):
        assert out.ok, out
        assert sink.started[job]["resumed_from_step"] >= 1, sink.started[job]
        assert out.mp4 == reference.generate(req)
    assert group.generation == generation + 1


def test_allgather_both_requests_resume_from_their_own_steps(dp2, reference) -> None:  # noqa: ANN001
    reqs = {"held0": GenerationRequest(prompt="held 0", seed=30, num_inference_steps=40),
            "held1": GenerationRequest(prompt="held 1", seed=31, num_inference_steps=40, cache=FBC)}
    killed_then_resumed(*dp2, reference, reqs, victim=1)


def test_two_experts_resume_from_their_steps(experts, experts_reference) -> None:  # noqa: ANN001
    d, _ = experts
    n = len(next(iter(d.executor._groups.values())).handles)
    reqs = {f"expert{i}": GenerationRequest(prompt=f"two experts {i}", seed=40 + i, num_inference_steps=40,
                                            extra={"guidance_scale_2": 2.5}) for i in range(n)}
    killed_then_resumed(*experts, experts_reference, reqs, victim=n - 1)


def test_dp1_a_killed_rank_resumes_its_cached_request(dp1, reference) -> None:  # noqa: ANN001
    req = GenerationRequest(prompt="keeps its residuals", seed=22, num_inference_steps=40, cache=FBC)
    killed_then_resumed(*dp1, reference, {"cached": req}, victim=0)


def test_dp1_a_killed_rank_resumes_its_request_from_its_last_step(dp1, reference) -> None:  # noqa: ANN001
    req = GenerationRequest(prompt="keeps its work", seed=21, num_inference_steps=40)
    killed_then_resumed(*dp1, reference, {"only": req}, victim=0)


def test_dp1_a_paused_request_goes_on_from_its_step(dp1, reference) -> None:  # noqa: ANN001
    d, sink = dp1
    (group,) = d.executor._groups.values()
    generation = group.generation
    req = GenerationRequest(prompt="paused", seed=23, num_inference_steps=40)
    submit(d, "paused", req)
    sink.wait_progress("paused", 2)
    assert d.preempt("paused")
    out = sink.wait(["paused"], timeout=400)[0]
    assert out.ok and out.mp4 == reference.generate(req), out
    assert [i for i, _ in sink.requeued] == ["paused"] and sink.started["paused"]["resumed_from_step"] >= 1
    assert group.generation == generation  # nothing died


def test_dp1_an_urgent_request_pauses_the_running_one_and_ends_first(dp1, reference) -> None:  # noqa: ANN001
    import dataclasses

    d, sink = dp1
    slow = GenerationRequest(prompt="long and patient", seed=25, num_inference_steps=40, priority=5)
    urgent = GenerationRequest(prompt="urgent", seed=26, num_inference_steps=4, priority=0)
    submit(d, "slow", slow)
    sink.wait_progress("slow", 2)
    submit(d, "urgent", urgent)
    outs = sink.wait(["slow", "urgent"], timeout=400)
    assert list(sink.finished) == ["urgent", "slow"]  # the urgent one ended first
    assert [i for i, _ in sink.requeued] == ["slow"] and sink.started["slow"]["resumed_from_step"] >= 1
    assert all(o.ok for o in outs), outs
    assert outs[0].mp4 == reference.generate(dataclasses.replace(slow, priority=0))  # priority: no bytes
    assert outs[1].mp4 == reference.generate(urgent)
