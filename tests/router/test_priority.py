"""Priorities: the queue serves the best (lowest) first, fair between keys within one, and a
better-priority request pauses a worse running one at its next forward (fake executor and
clock: the rules, in milliseconds; the real pause and resume on ranks, bytes equal, is
tests/api/test_priority_http.py).

- the policy (``victims``): strictly worse only, the worst first, one pause per waiting
  request (pauses under way count), at most ``max_preemptions`` per request;
- the dispatcher: the paused request is queued again with its state (not a rerun), the
  urgent one takes the rank, the paused one goes on from its step and is never lost;
  a request with no state kept or an equal priority pauses nothing;
- waves: the best priority starts first; a better one waiting pauses a whole wave, only
  one all of whose requests can be paused, and none while a group is free.
"""

from __future__ import annotations

import dataclasses

import torch

from service.models.request import GenerationRequest
from service.models.resume import StepState
from service.router.priority import Running, victims, wave_victims
from service.router.tenants import Tenants
from tests.router.test_dispatcher import make

REQ = GenerationRequest(prompt="p", num_inference_steps=4)


def at(priority: int) -> GenerationRequest:
    return dataclasses.replace(REQ, priority=priority)


def st(step: int) -> StepState:
    return StepState.of(step, 4, torch.full((1, 16, 2, 2, 2), float(step)))


def payload(ex, job: str) -> GenerationRequest:  # noqa: ANN001
    return [a[3] for a in ex.assigned if a[2] == job][-1]


def submit(d, job: str, priority: int, tenant: str | None = None) -> None:  # noqa: ANN001
    req = at(priority)
    d.submit(job, req.compat_key(), req, tenant=tenant)


def test_the_policy_pauses_the_worst_strictly_worse_once_per_waiting_request() -> None:
    run = [Running("p5", 5, 0, 1.0), Running("p3", 3, 0, 2.0), Running("p0", 0, 0, 3.0)]
    assert victims([0], run, 0) == ["p5"]
    assert victims([0, 1], run, 0) == ["p5", "p3"]
    assert victims([0, 1], run, 1) == ["p5"]  # one pause under way serves the best waiting one
    assert victims([0, 0, 0], run, 0) == ["p5", "p3"]  # equal priority is never paused
    assert victims([5], run, 0) == []
    assert victims([], run, 0) == []
    tired = [Running("a", 5, 2, 1.0), Running("b", 5, 1, 2.0), Running("c", 5, 1, 3.0)]
    assert victims([0], tired, 0, max_preemptions=2) == ["c"]  # least paused, then latest started
    assert victims([0, 0, 0], tired, 0, max_preemptions=2) == ["c", "b"]
    assert victims([0], tired, 0, max_preemptions=1) == []


def test_the_wave_policy_pauses_one_whole_wave_all_of_it_worse_and_preemptible() -> None:
    a, b, c = Running("a", 5, 0, 1.0), Running("b", 3, 0, 2.0), Running("c", 7, 0, 3.0)
    assert wave_victims([0], [[a, c], [b]], 0) == ["a", "c"]  # its best (5) is worse than 3
    assert wave_victims([0], [[a, c], [b]], 1) == []  # a pause under way: its group frees first
    assert wave_victims([4], [[a, c], [b]], 0) == ["a", "c"]
    assert wave_victims([5], [[a, c], [b]], 0) == []  # a (5) is not strictly worse
    assert wave_victims([0], [[a, None], [b]], 0) == ["b"]  # a wave with a member that cannot pause
    assert wave_victims([0], [[Running("t", 5, 2, 1.0)]], 0) == []  # paused twice already
    assert wave_victims([], [[a]], 0) == []


def test_an_urgent_request_pauses_the_worse_one_on_the_only_rank_which_goes_on_later() -> None:
    d, ex, sink, _ = make(sizes=(1,), job_retries=0)  # a pause needs no rerun left
    submit(d, "slow", 5)
    d.step(0)
    ex.hand_off("slow", st(2))
    d.step(0)
    submit(d, "urgent", 0)
    d.step(0)
    d.step(0)  # (a cancel decided in one round is sent at the start of the next)
    assert ex.cancels == [("g0", 0, "slow")]  # asked to stop at its next forward
    d.step(0)
    assert ex.cancels == [("g0", 0, "slow")]  # once: the pause under way serves the urgent one
    ex.finish("slow", cancelled=True)
    d.step(0)
    assert sink.requeued == [("slow", "preempted: paused at a forward boundary")]
    d.step(0)
    assert ex.on("urgent") == ("g0", 0) and "slow" not in sink.finished
    ex.run("urgent")
    d.step(0)
    d.step(0)
    assert sink.finished["urgent"].ok
    again = payload(ex, "slow")
    assert again.resume is not None and again.resume.step == 2 and again.priority == 5
    assert sink.started["slow"]["resumed_from_step"] == 2
    ex.run("slow")
    d.step(0)
    assert sink.finished["slow"].ok and list(sink.finished) == ["urgent", "slow"]


def test_a_request_is_paused_at_most_max_preemptions_times() -> None:
    d, ex, sink, _ = make(sizes=(1,), max_preemptions=1)
    submit(d, "slow", 5)
    d.step(0)
    ex.hand_off("slow", st(1))
    submit(d, "u1", 0)
    d.step(0)
    d.step(0)
    ex.finish("slow", cancelled=True)
    d.step(0)
    d.step(0)
    ex.run("u1")
    d.step(0)
    d.step(0)
    assert payload(ex, "slow").resume.step == 1  # going on again
    ex.hand_off("slow", st(2))
    submit(d, "u2", 0)
    d.step(0)
    d.step(0)
    assert [c[2] for c in ex.cancels] == ["slow"]  # paused once: not again
    ex.run("slow")
    d.step(0)
    d.step(0)
    assert sink.finished["slow"].ok and ex.on("u2") == ("g0", 0)


def test_nothing_is_paused_without_a_state_or_for_an_equal_priority() -> None:
    d, ex, sink, _ = make(sizes=(1,))
    submit(d, "fresh", 5)
    d.step(0)
    submit(d, "urgent", 0)
    d.step(0)
    assert ex.cancels == []  # no step kept: pausing it would throw its work away
    ex.hand_off("fresh", st(1))
    for _ in range(3):  # the state arrives, the pause is decided, its cancel is sent
        d.step(0)
    assert ex.cancels == [("g0", 0, "fresh")]  # now it can go on later
    d2, ex2, _, _ = make(sizes=(1,))
    submit(d2, "a", 0)
    d2.step(0)
    ex2.hand_off("a", st(1))
    submit(d2, "b", 0)
    d2.step(0)
    d2.step(0)
    assert ex2.cancels == []


def test_the_best_priority_goes_first_and_keys_share_within_it() -> None:
    d, ex, sink, clock = make(sizes=(1,), tenants=Tenants(), max_preemptions=0)
    submit(d, "blocker", 0, tenant="k1")
    d.step(0)
    for job, p, tenant in (("k1-low", 5, "k1"), ("k1-a", 0, "k1"), ("k1-b", 0, "k1"), ("k2-a", 0, "k2"),
                           ("k2-hi", -3, "k2")):
        submit(d, job, p, tenant)
        clock.advance(1)
    order = []
    current = "blocker"
    for _ in range(5):
        ex.run(current)
        d.step(0)
        d.step(0)
        current = [a[2] for a in ex.assigned][-1]
        order.append(current)
    # -3 first; then priority 0, k1 and k2 in turn (k2 just ran: k1's oldest, then k2's); 5 last
    assert order == ["k2-hi", "k1-a", "k2-a", "k1-b", "k1-low"]


def test_waves_start_the_best_priority_first_when_the_group_frees() -> None:
    d, ex, sink, clock = make(sizes=(2,), waves=True)
    for job in ("w1", "w2"):
        submit(d, job, 0)
    d.step(0)
    assert {ex.on("w1"), ex.on("w2")} == {("g0", 0), ("g0", 1)}
    submit(d, "low1", 5)
    submit(d, "low2", 5)  # a full wave of priority 5 ...
    clock.advance(1)
    urgent = dataclasses.replace(at(0), width=64)  # ... and a lone later priority-0 one of another key
    d.submit("urgent", urgent.compat_key(), urgent)
    d.step(0)
    assert ex.cancels == []  # a running wave of the same priority is not paused
    ex.run("w1")
    ex.run("w2")
    d.step(0)
    clock.advance(0.1)  # the lone one's wait for a partner (0.05)
    d.step(0)
    d.step(0)
    assert [a[2] for a in ex.assigned][2:] == ["urgent"]
    ex.run("urgent")
    d.step(0)
    d.step(0)
    assert [a[2] for a in ex.assigned][3:] == ["low1", "low2"]


def test_under_waves_a_better_request_pauses_a_whole_wave_which_goes_on_later() -> None:
    d, ex, sink, clock = make(sizes=(2,), waves=True, job_retries=0)
    submit(d, "w1", 5)
    submit(d, "w2", 5)
    d.step(0)
    ex.hand_off("w1", st(2))
    d.step(0)
    urgent = dataclasses.replace(at(0), width=64)
    d.submit("urgent", urgent.compat_key(), urgent)
    for _ in range(3):
        d.step(0)
    assert ex.cancels == []  # w2 kept no state yet: the wave cannot be paused whole
    ex.hand_off("w2", st(1))
    for _ in range(3):
        d.step(0)
    assert sorted(c[2] for c in ex.cancels) == ["w1", "w2"]  # the whole wave, once
    ex.finish("w1", cancelled=True)
    ex.finish("w2", cancelled=True)
    d.step(0)
    assert sorted(j for j, _ in sink.requeued) == ["w1", "w2"]
    clock.advance(0.1)  # the lone urgent one's wait for a partner (0.05)
    d.step(0)
    d.step(0)
    assert [a[2] for a in ex.assigned][2:] == ["urgent"]
    ex.run("urgent")
    d.step(0)
    d.step(0)
    assert {a[2]: a[3].resume.step for a in ex.assigned[3:]} == {"w1": 2, "w2": 1}  # from their steps
    ex.run("w1")
    ex.run("w2")
    d.step(0)
    assert all(sink.finished[j].ok for j in ("urgent", "w1", "w2")) and list(sink.finished)[0] == "urgent"


def test_under_waves_nothing_is_paused_while_a_group_is_free() -> None:
    d, ex, _, clock = make(sizes=(1, 1), waves=True)
    submit(d, "slow", 5)
    d.step(0)
    ex.hand_off("slow", st(1))
    d.step(0)
    submit(d, "urgent", 0)
    for _ in range(3):
        d.step(0)
    assert ex.cancels == []  # the other group takes it (once its partial wave's wait is over)
    clock.advance(0.1)
    d.step(0)
    d.step(0)
    assert ex.on("urgent")[0] != ex.on("slow")[0]
