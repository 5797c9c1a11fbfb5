"""The dispatcher fills a busy rank's batch with queued requests of its batch key, up to
the cap, and never with another key (fake executor and clock: the rules, in milliseconds).
What a rank does with them is tested on the real model in tests/engine/test_rank_batch.py."""

from __future__ import annotations

from dataclasses import replace

import torch

from service.config import EngineConfig, SchedulerConfig
from service.models.request import GenerationRequest
from service.models.resume import StepState
from service.router.dispatcher import Dispatcher
from service.router.policy import DeadlinePolicy
from service.router.scheduler import ContinuousScheduler
from tests.fakes import Clock, FakeExecutor, RecordingSink

REQ = GenerationRequest(prompt="p", num_inference_steps=2)
OTHER = replace(REQ, width=64)  # another shape: another batch key


def make(cap: int | str, **kw: object) -> tuple[Dispatcher, FakeExecutor, RecordingSink]:
    ex = FakeExecutor((1,), config=EngineConfig(scheduler=SchedulerConfig(max_batch_size=cap)))
    sink = RecordingSink()
    d = Dispatcher(ex, sink, ContinuousScheduler(64, 30.0), clock=Clock(),
                   deadlines=DeadlinePolicy(base_s=60, per_forward_s=1.0), **kw)  # type: ignore[arg-type]
    d.open()
    d.step(0)
    return d, ex, sink


def submit(d: Dispatcher, job: str, req: GenerationRequest, priority: int = 0) -> None:
    req = replace(req, priority=priority)
    d.submit(job, req.compat_key(), req)


def test_requests_of_one_key_join_the_running_batch_up_to_the_cap_others_wait() -> None:
    d, ex, sink = make(3)
    for job, req in (("a", REQ), ("x", OTHER), ("b", replace(REQ, seed=7, num_inference_steps=5)),
                     ("c", replace(REQ, seed=8)), ("d", REQ)):
        submit(d, job, req)
    d.step(0)
    assert [j for _, _, j, _ in ex.assigned] == ["a", "b", "c"]  # seeds and steps differ: one key
    assert [h["reason"] for h in d.history] == ["free_rank", "batch", "batch"]
    ex.run("b")  # a member leaves: the oldest of the key takes its place, never the other shape
    d.step(0)
    d.step(0)
    assert [j for _, _, j, _ in ex.assigned] == ["a", "b", "c", "d"]
    for j in "acd":
        ex.run(j)
    d.step(0)
    d.step(0)
    assert ex.assigned[-1][2] == "x" and all(sink.finished[j].ok for j in "abcd")


def test_max_batch_size_1_and_auto_without_a_probe_give_one_request_per_rank() -> None:
    for cap in (1, "auto"):  # auto: no probe measured that transfer binds (CPU, the fake)
        d, ex, _ = make(cap)
        for job in "ab":
            submit(d, job, REQ)
        d.step(0)
        assert [j for _, _, j, _ in ex.assigned] == ["a"], cap


def test_a_better_priority_of_another_key_pauses_one_member_the_rest_of_the_batch_goes_on() -> None:
    d, ex, sink = make(2, job_retries=0)
    submit(d, "a", REQ, priority=5)
    submit(d, "b", REQ, priority=5)
    d.step(0)
    for j in "ab":
        ex.hand_off(j, StepState.of(1, 2, torch.zeros(1, 16, 2, 2, 2)))  # a state kept: it can pause
    d.step(0)
    submit(d, "urgent", OTHER, priority=0)
    d.step(0)
    d.step(0)  # (a cancel decided in one round is sent at the start of the next)
    assert len(ex.cancels) == 1  # one member leaves at its next forward, the other goes on
    paused = ex.cancels[0][2]
    ex.finish(paused, cancelled=True)
    d.step(0)
    assert sink.requeued == [(paused, "preempted: paused at a forward boundary")]
    other = "b" if paused == "a" else "a"
    ex.run(other)
    d.step(0)
    d.step(0)
    assert sink.finished[other].ok and ex.on("urgent") == ("g0", 0)
