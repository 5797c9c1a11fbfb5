"""The dispatcher's bookkeeping of per-step state (fake executor: what the ranks report is
asked for; the real hand-off is tests/engine/test_state.py and the real reruns
tests/engine/test_resume_e2e.py).

- it keeps the latest state of each held request, never an older one that comes late;
- a request its group's failure requeues goes to the rebuilt group as its request resumed
  from that state, and ``on_start`` says ``resumed_from_step``; one that never handed off
  a state starts from 0;
- a state is dropped when its request ends (completed, failed, cancelled while queued),
  and a STEP of a request no longer held (its group failed) keeps nothing;
- ``preempt`` pauses a running request that has a state (a cancel to its rank), queues it
  again uncounted, and it goes on from that state; a user's cancel wins over a pause;
- each start from a kept state counts in ``dloserve_resumes_total`` with why it stopped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from service.engine.metrics import metrics
from service.models.request import GenerationRequest
from service.models.resume import StepState
from tests.router.test_dispatcher import make

REQ = GenerationRequest(prompt="p", num_inference_steps=4)


def st(step: int, total: int = 4) -> StepState:
    return StepState.of(step, total, torch.full((1, 16, 2, 2, 2), float(step)))


def give(d, *ids: str) -> None:  # noqa: ANN001
    for i in ids:
        d.submit(i, REQ.compat_key(), REQ)
    d.step(0)


def payload(ex, job: str) -> GenerationRequest:  # noqa: ANN001
    return [a[3] for a in ex.assigned if a[2] == job][-1]


def test_a_requeued_request_goes_on_from_its_last_state() -> None:
    d, ex, sink, _ = make(sizes=(2,))
    give(d, "a", "b", "c")  # c waits in the queue
    assert payload(ex, "a").resume is None and sink.started["a"]["resumed_from_step"] == 0
    ex.hand_off("a", st(1))
    ex.hand_off("a", st(2))
    ex.hand_off("a", st(1))  # late (a GPU copy lands after the next): never replaces a newer one
    ex.hand_off("b", st(3))
    d.step(0)
    assert d._states["a"].step == 2 and d._states["b"].step == 3
    assert "a" not in sink.progress  # a state's STEP is not progress: that comes on its own STEPs
    ex.kill("g0", "rank 0 died: SIGKILL", rank=0)
    ex.hand_off("a", st(3))  # said by the dead group: dropped (the executor drops them; the job is not held)
    d.step(0)
    assert sorted(i for i, _ in sink.requeued) == ["a", "b"]
    d.step(0)
    d.step(0)  # rebuilt: a and b go first, ahead of c
    for job, step in (("a", 2), ("b", 3)):
        again = payload(ex, job)
        assert again.resume is not None and again.resume.step == step
        assert sink.started[job]["resumed_from_step"] == step
        assert torch.equal(again.resume.tensor(), st(step).tensor()) and again.forwards() == (4 - step) * 2
        assert again.prompt == REQ.prompt and again.seed == REQ.seed
    ex.run("a")
    ex.run("b")
    d.step(0)
    assert sink.finished["a"].ok and sink.finished["b"].ok
    assert d._states == {}  # ended: forgotten
    d.step(0)
    assert sink.started["c"]["resumed_from_step"] == 0 and payload(ex, "c").resume is None


def test_a_state_is_dropped_when_its_request_ends_any_way() -> None:
    d, ex, sink, clock = make(sizes=(1,), job_retries=0)
    give(d, "failed", "queued")
    ex.hand_off("failed", st(1))
    d.step(0)
    assert "failed" in d._states
    ex.kill("g0")  # no reruns: it fails
    d.step(0)
    assert not sink.finished["failed"].ok and "failed" not in d._states
    d2, ex2, sink2, _ = make(sizes=(1,))
    give(d2, "x", "y")
    ex2.hand_off("x", st(2))
    d2.step(0)
    ex2.kill("g0")
    d2.step(0)
    assert "x" in d2._states  # queued again, its state kept for the rerun
    assert d2.cancel("x") == "queued" and "x" not in d2._states


def test_a_preempted_request_pauses_and_goes_on_from_its_last_state() -> None:
    d, ex, sink, _ = make(sizes=(1,), job_retries=0)  # a pause is no rerun: it needs none left
    give(d, "long")
    assert not d.preempt("long")  # no step kept yet: pausing would throw its work away
    ex.hand_off("long", st(2))
    d.step(0)
    assert d.preempt("long") and not d.preempt("long")
    d.step(0)
    assert ex.cancels == [("g0", 0, "long")]  # the rank stops it at its next forward
    ex.finish("long", cancelled=True)
    d.step(0)
    assert sink.requeued == [("long", "preempted: paused at a forward boundary")]
    assert "long" not in sink.finished
    d.step(0)
    again = payload(ex, "long")
    assert again.resume.step == 2 and sink.started["long"]["resumed_from_step"] == 2
    ex.run("long")
    d.step(0)
    assert sink.finished["long"].ok and d._states == {}
    assert not d.preempt("missing")


def test_a_cancel_wins_over_a_pause_and_a_finished_request_is_not_paused() -> None:
    d, ex, sink, _ = make(sizes=(2,))
    give(d, "a", "b")
    ex.hand_off("a", st(1))
    ex.hand_off("b", st(1))
    d.step(0)
    assert d.preempt("a") and d.cancel("a") == "running"
    assert d.preempt("b")
    d.step(0)
    ex.finish("a", cancelled=True)
    ex.run("b")  # it ended before the pause reached its rank (decode cannot be paused)
    d.step(0)
    assert sink.finished["a"].cancelled and sink.finished["b"].ok and not sink.requeued


class Counted:
    """Stands in for one Ray counter: what the dispatcher counted, with its tags."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, dict[str, Any]]] = []

    def inc(self, value: int = 1, tags: dict[str, Any] | None = None) -> None:
        self.seen.append((value, dict(tags or {})))


def test_each_start_from_a_kept_step_counts_as_a_resume_with_its_cause(monkeypatch: pytest.MonkeyPatch,
                                                                        ) -> None:
    resumes = Counted()
    monkeypatch.setitem(metrics(), "resumes", resumes)
    d, ex, sink, _ = make(sizes=(1,))
    give(d, "a")
    ex.hand_off("a", st(1))
    d.step(0)
    ex.kill("g0")  # its rank died: a rerun from step 1
    d.step(0)
    d.step(0)
    d.step(0)
    assert payload(ex, "a").resume.step == 1
    ex.hand_off("a", st(2))
    d.step(0)
    assert d.preempt("a")
    d.step(0)
    ex.finish("a", cancelled=True)  # paused: it goes on from step 2
    d.step(0)
    d.step(0)
    assert payload(ex, "a").resume.step == 2
    ex.run("a")
    restored = dataclasses.replace(REQ, resume=st(3))  # a restart's: its request and its saved step
    assert d.adopt("b", REQ.compat_key(), restored)
    give(d, "fresh")  # from step 0: no resume
    d.step(0)
    assert sink.started["b"]["resumed_from_step"] == 3
    ex.run("b")
    d.step(0)
    d.step(0)
    assert sink.started["fresh"]["resumed_from_step"] == 0
    causes = [(n, tags["group"], tags["cause"]) for n, tags in resumes.seen]
    assert causes == [(1, "g0", "rerun"), (1, "g0", "preempted"), (1, "g0", "adopted")]
