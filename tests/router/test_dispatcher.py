"""The dispatcher's rules on the fake executor and a fake clock: who runs, who fails, when
groups are retried, what admission says. Milliseconds each; no sleeps, no Ray.

The same rules on real Ray actors (a rank SIGKILLed) are in tests/engine/test_ray_executor.py
and tests/api/test_http.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from service.models.request import GenerationRequest
from service.router.dispatcher import Dispatcher
from service.router.health import Availability, Unavailable
from service.router.policy import DeadlinePolicy
from service.router.queue import QueueFull
from service.router.scheduler import ContinuousScheduler, WaveScheduler
from service.router.tenants import Quota, QuotaExceeded, Tenants
from tests.fakes import Clock, FakeExecutor, RecordingSink

REQ = GenerationRequest(prompt="p", num_inference_steps=2)  # 4 forwards
BIG = GenerationRequest(prompt="p", num_inference_steps=2, width=64)


def make(sizes: tuple[int, ...] = (2,), outcomes: dict[int, list[bool]] | None = None, waves: bool = False,
         tenants: Tenants | None = None, queue: int = 64,
         **kw: Any) -> tuple[Dispatcher, FakeExecutor, RecordingSink, Clock]:
    ex, sink, clock = FakeExecutor(sizes, outcomes or {}), RecordingSink(), Clock()
    sched = (WaveScheduler(max(sizes), max_wait_s=0.05, max_queue=queue, tenants=tenants) if waves
             else ContinuousScheduler(queue, 30.0, tenants=tenants))
    d = Dispatcher(ex, sink, sched, deadlines=DeadlinePolicy(base_s=60, per_forward_s=1.0), clock=clock, **kw)
    d.open()
    d.step(0)  # the groups' READY (or START_FAILED) events
    return d, ex, sink, clock


def submit(d: Dispatcher, *ids: str, req: GenerationRequest = REQ, tenant: str | None = None) -> None:
    for i in ids:
        d.submit(i, req.compat_key(), req, tenant=tenant)


def rebuilt_then_done(d: Dispatcher, ex: FakeExecutor, sink: RecordingSink, job: str) -> None:
    """Two rounds (the rebuild is tried and READY comes back), then ``job`` runs to the end."""
    d.step(0)
    d.step(0)
    ex.run(job)
    d.step(0)
    assert sink.finished[job].ok


def test_a_freed_rank_takes_the_next_request_at_once_and_outcomes_reach_the_sink() -> None:
    d, ex, sink, _ = make()
    submit(d, "a", "b", "c")
    d.step(0)
    assert [(g, r, j) for g, r, j, _ in ex.assigned] == [("g0", 0, "a"), ("g0", 1, "b")]
    assert d.depth == 1 and d.held == 2
    ex.forwards_done("a")  # a's rank is free while a decodes: c starts there
    d.step(0)
    d.step(0)
    assert ex.on("c") == ("g0", 0) and sink.progress["a"] == 2
    ex.finish("a")
    ex.run("b")
    ex.run("c")
    d.step(0)
    assert all(sink.finished[i].ok for i in "abc") and sink.finished["a"].mp4 == b"mp4 of a"
    assert sink.finished["a"].timings["queue_s"] == 0.0 and "denoise_s" in sink.finished["a"].timings


def test_a_dead_rank_fails_its_allgather_groups_requests_and_the_queue_waits_for_the_rebuild() -> None:
    d, ex, sink, _ = make(job_retries=0)
    submit(d, "a", "b", "c")
    d.step(0)
    ex.kill("g0", "rank 1 died: SIGKILL")
    d.step(0)  # both held requests fail (their gathers cannot finish); a rebuild starts at once
    assert sink.finished["a"].error == sink.finished["b"].error == "rank 1 died: SIGKILL"
    assert "c" not in sink.finished and ex.attempts["g0"] == 1 and not sink.requeued
    d.step(0)  # the retry is due now: rebuild, READY
    d.step(0)
    assert ex.attempts["g0"] == 2 and ex.on("c") == ("g0", 0)
    ex.run("c")
    d.step(0)
    assert sink.finished["c"].ok


def test_the_requests_a_dead_rank_held_run_again_first_and_fail_on_a_second_death() -> None:
    d, ex, sink, _ = make()  # job_retries=1, the default
    submit(d, "a", "b", "c")
    d.step(0)
    ex.kill("g0", "rank 1 died: SIGKILL", rank=1)  # b's rank: b is the suspect, a stood by
    d.step(0)
    assert sorted(sink.requeued) == [("a", "rank 1 died: SIGKILL"), ("b", "rank 1 died: SIGKILL")]
    assert not sink.finished and d.depth == 3 and d.held == 0
    d.step(0)
    d.step(0)  # rebuilt: the two go again before c, which came later
    assert ex.attempts["g0"] == 2 and (ex.on("a"), ex.on("b")) == (("g0", 0), ("g0", 1))
    runs = [r for r in d.history if r["ids"] == ["a"]]  # /v1/waves: the first run says what happened
    assert [r.get("requeued") for r in runs] == [True, None] and runs[0]["errors"] == ["rank 1 died: SIGKILL"]
    ex.run("a")
    d.step(0)
    d.step(0)
    assert sink.finished["a"].ok and ex.on("c") == ex.on("a")
    ex.kill("g0", "rank 1 died: SIGKILL", rank=1)  # b's rank again: b has no rerun left; c stood by
    d.step(0)
    assert sink.finished["b"].error == "rank 1 died: SIGKILL (its rank group failed under it 2 times)"
    assert "c" not in sink.finished and sink.requeued[-1] == ("c", "rank 1 died: SIGKILL")
    rebuilt_then_done(d, ex, sink, "c")


def test_a_request_that_only_stood_by_reruns_whatever_the_count() -> None:
    d, ex, sink, _ = make(sizes=(2,))
    submit(d, "victim", "x1")
    d.step(0)
    for n, other in enumerate(("x2", "x3"), start=1):
        ex.kill("g0", "rank 1 died: SIGKILL", rank=1)  # never the victim's rank (0)
        submit(d, other)
        d.step(0)
        d.step(0)
        d.step(0)
        assert ex.on("victim") == ("g0", 0) and "victim" not in sink.finished
        assert [i for i, _ in sink.requeued].count("victim") == n
    ex.kill("g0", "rank 0 failed: RuntimeError: CUDA error", rank=0)  # a device error on its rank: it fails
    d.step(0)
    assert "CUDA error" in sink.finished["victim"].error and "3 times" in sink.finished["victim"].error
    assert "2 times" in sink.finished["x1"].error  # the suspect of both deaths: one rerun, then failed
    assert sink.requeued[-1][0] == "x2"  # on the other rank it stood by: it runs again


def test_a_collective_that_lost_its_peer_counts_as_a_death_not_as_the_requests_error() -> None:
    d, ex, sink, _ = make()
    submit(d, "a", "b")
    d.step(0)
    ex.kill("g0", "rank 0 failed: RuntimeError: [pair.cc:598] Connection reset by peer", rank=0)
    d.step(0)
    assert sorted(i for i, _ in sink.requeued) == ["a", "b"] and not sink.finished


def test_with_no_job_retries_nothing_runs_again() -> None:
    d, ex, sink, _ = make(job_retries=0)
    submit(d, "a", "b")
    d.step(0)
    ex.kill("g0", "rank 1 died: SIGKILL", rank=1)
    d.step(0)
    assert not sink.requeued
    assert sink.finished["a"].error == sink.finished["b"].error == "rank 1 died: SIGKILL"


def test_rank_local_groups_fail_alone() -> None:
    d, ex, sink, _ = make(sizes=(1, 1), job_retries=0)
    submit(d, "a", "b")
    d.step(0)
    assert {ex.on("a")[0], ex.on("b")[0]} == {"g0", "g1"}
    dead = ex.on("a")[0]
    ex.kill(dead)
    ex.run("b")
    d.step(0)
    assert sink.finished["a"].error and sink.finished["b"].ok


def test_a_rank_local_death_reruns_only_its_own_request() -> None:
    d, ex, sink, _ = make(sizes=(1, 1))
    submit(d, "a", "b")
    d.step(0)
    dead, live = ex.on("a")[0], ex.on("b")[0]
    ex.kill(dead)
    d.step(0)
    assert [i for i, _ in sink.requeued] == ["a"] and ex.on("b")[0] == live and not sink.finished
    ex.run("b")
    d.step(0)
    d.step(0)  # a goes to whichever group is free first
    ex.run("a")
    d.step(0)
    assert sink.finished["a"].ok and sink.finished["b"].ok


def test_a_missed_deadline_fails_the_group_naming_only_each_jobs_own_id() -> None:
    d, ex, sink, clock = make(job_retries=0)
    submit(d, "late", "other")
    d.step(0)
    deadline = sink.started["late"]["deadline_s"]
    clock.advance(deadline + 1)
    d.step(0)
    assert sink.finished["late"].error == f"exceeded its deadline of {deadline:.0f}s"
    assert "late" not in (sink.finished["other"].error or "") and "deadline" in sink.finished["other"].error
    d.step(0)
    assert ex.attempts["g0"] == 2  # rebuilt


def test_a_missed_deadline_fails_the_late_request_and_reruns_the_other() -> None:
    d, ex, sink, clock = make()
    submit(d, "late", "other")
    d.step(0)
    clock.advance(sink.started["late"]["deadline_s"] + 1)
    d.step(0)
    assert "deadline" in sink.finished["late"].error and "other" not in sink.finished
    (rid, why), = sink.requeued
    assert rid == "other" and "late" not in why
    rebuilt_then_done(d, ex, sink, "other")


def test_a_rebuild_that_fails_twice_is_retried_with_backoff_and_queued_jobs_complete() -> None:
    d, ex, sink, clock = make(sizes=(1,), outcomes={0: [True, False, False, True]}, job_retries=0)
    submit(d, "held", "queued")
    d.step(0)
    ex.kill("g0")
    d.step(0)  # held fails; rebuild attempt 2 at once ...
    d.step(0)
    assert ex.attempts["g0"] == 2  # ... which fails: the next comes at once too
    assert d.availability()[0] is Availability.RECOVERING
    submit(d, "during")  # accepted: it will wait
    d.step(0)
    d.step(0)
    assert ex.attempts["g0"] == 3  # failed again: now the service is down, the next try in 1 s
    avail, why = d.availability()
    assert avail is Availability.DOWN and "attempt 3 failed" in why
    with pytest.raises(Unavailable) as refused:
        submit(d, "refused")
    assert refused.value.retry_after_s >= 1
    d.step(0)
    assert ex.attempts["g0"] == 3
    clock.advance(1.0)
    d.step(0)
    d.step(0)
    assert ex.attempts["g0"] == 4 and d.availability()[0] is Availability.SERVING
    assert sink.finished["held"].error and "queued" not in sink.finished
    ex.run("queued")
    d.step(0)
    d.step(0)
    ex.run("during")
    d.step(0)
    assert sink.finished["queued"].ok and sink.finished["during"].ok and "refused" not in sink.finished


def test_one_shot_front_ends_give_up_after_max_attempts() -> None:
    d, ex, sink, _ = make(sizes=(1,), outcomes={0: [False, False]}, max_attempts=2)
    submit(d, "a")  # the first attempt failed, the retry is due: accepted, waits
    d.step(0)
    d.step(0)
    assert ex.attempts["g0"] == 2 and "attempt 2 failed" in sink.finished["a"].error
    with pytest.raises(Unavailable):
        submit(d, "b")


def test_cancel_queued_and_running_jobs() -> None:
    d, ex, sink, _ = make(sizes=(1,))
    submit(d, "run", "wait")
    d.step(0)
    assert d.cancel("wait") == "queued" and d.depth == 0
    assert d.cancel("run") == "running" and d.cancel("nope") == "missing"
    d.step(0)
    assert ex.cancels == [("g0", 0, "run")]
    ex.run("run", cancelled=True)
    d.step(0)
    out = sink.finished["run"]
    assert out.cancelled and out.error == "cancelled" and not out.ok and "wait" not in sink.finished


def test_a_cancel_that_arrives_during_decode_still_ends_cancelled() -> None:
    d, ex, sink, _ = make(sizes=(1,))
    submit(d, "a")
    d.step(0)
    ex.forwards_done("a")
    d.step(0)
    d.cancel("a")
    ex.finish("a")  # the rank could not stop it any more: its MP4 is dropped
    d.step(0)
    assert sink.finished["a"].cancelled and sink.finished["a"].mp4 is None


def test_a_refused_assignment_fails_that_request_only() -> None:
    d, ex, sink, _ = make()
    submit(d, "a", "b")
    d.step(0)
    ex.refuse("a")
    ex.run("b")
    d.step(0)
    assert sink.finished["a"].error == "rank refused: ValueError: nope" and sink.finished["b"].ok


def test_queued_jobs_wait_at_most_max_queue_wait() -> None:
    d, ex, sink, clock = make(sizes=(1,), max_queue_wait_s=30)
    submit(d, "a", "b")
    d.step(0)
    clock.advance(29)
    d.step(0)
    assert "b" not in sink.finished
    clock.advance(2)
    d.step(0)
    assert "waited 31 s in the queue" in sink.finished["b"].error and "a" not in sink.finished


def test_waves_start_only_on_a_free_group_and_hold_one_key() -> None:
    d, ex, sink, clock = make(waves=True)
    submit(d, "a", "b")
    submit(d, "x", req=BIG)
    d.step(0)
    assert [j for _, _, j, _ in ex.assigned] == ["a", "b"] and sink.started["a"]["size"] == 2
    ex.forwards_done("a")
    clock.advance(1)
    d.step(0)
    assert len(ex.assigned) == 2  # b still forwards: the wave holds the group
    ex.forwards_done("b")
    d.step(0)
    d.step(0)
    assert ex.assigned[-1][2] == "x" and sink.started["x"]["reason"] == "timeout"


def test_stop_fails_what_is_queued_and_held_and_closes_the_executor() -> None:
    d, ex, sink, _ = make(sizes=(1,))
    submit(d, "a", "b")
    d.step(0)
    d.stop()
    assert sink.finished["a"].error == sink.finished["b"].error == "service stopped" and ex.closed


def test_status_says_which_state_the_engine_is_in() -> None:
    d, ex, _, _ = make(outcomes={0: [False, False]})
    st = d.status()
    assert st["state"] == "failed" and st["availability"] == "recovering"
    d.step(0)
    d.step(0)
    assert d.status()["state"] == "down"


# -- tenants: fair share and quotas ------------------------------------------------------
def assigned(ex: FakeExecutor) -> list[str]:
    return [j for _, _, j, _ in ex.assigned]


def test_a_flooding_key_delays_another_keys_first_job_by_at_most_one_job_per_rank() -> None:
    d, ex, sink, _ = make(queue=128)
    submit(d, *(f"a{i}" for i in range(70)), tenant="key-a")
    d.step(0)
    submit(d, "b0", tenant="key-b")  # arrives with both ranks busy and 68 of key-a's waiting
    d.step(0)
    assert assigned(ex) == ["a0", "a1"]
    ex.forwards_done("a0")  # the first rank to free goes to key-b
    d.step(0)
    d.step(0)
    assert assigned(ex) == ["a0", "a1", "b0"] and ex.on("b0") == ("g0", 0)
    ex.finish("a0")
    submit(d, "b1", tenant="key-b")
    ex.forwards_done("a1")  # each key holds one request (a1 decodes): key-a was served longer ago
    d.step(0)
    d.step(0)
    assert assigned(ex)[-1] == "a2"


def test_waves_share_the_group_between_keys() -> None:
    d, ex, sink, clock = make(waves=True)
    submit(d, *(f"a{i}" for i in range(10)), tenant="key-a")
    d.step(0)
    submit(d, "b0", tenant="key-b")  # the same compatibility key: it rides in the next wave
    submit(d, "c0", req=BIG, tenant="key-c")  # another one: a wave of its own, after key-b's turn
    for j in ("a0", "a1"):
        ex.run(j)
    clock.advance(1)
    d.step(0)
    d.step(0)
    assert assigned(ex)[2:] == ["b0", "a2"]
    for j in ("b0", "a2"):
        ex.run(j)
    d.step(0)
    d.step(0)
    assert assigned(ex)[4:] == ["c0"] and sink.started["c0"]["key"] == BIG.compat_key()


def test_a_keys_queue_quota_is_429_about_that_key_and_others_still_get_in() -> None:
    d, ex, _, _ = make(tenants=Tenants(Quota(max_queued=2)), queue=5)
    submit(d, "a0", "a1", tenant="key-a")
    d.step(0)
    submit(d, "a2", "a3", tenant="key-a")  # two run, two wait: its quota
    with pytest.raises(QuotaExceeded) as e:
        submit(d, "a4", tenant="key-a")
    assert e.value.limit == 2 and e.value.retry_after_s >= 1 and "max_queued 2" in str(e.value)
    submit(d, "b0", "b1", tenant="key-b")
    with pytest.raises(QueueFull):  # the whole queue (5) is full before key-c's quota is
        submit(d, "c0", "c1", tenant="key-c")
    assert d.counts("key-a") == {"queued": 2, "running": 2}
    assert d.counts("key-c") == {"queued": 1, "running": 0}


def test_a_keys_running_limit_leaves_the_other_ranks_to_other_keys() -> None:
    d, ex, _, _ = make(tenants=Tenants(overrides={"key-a": Quota(max_running=1)}))
    submit(d, "a0", "a1", "a2", tenant="key-a")
    d.step(0)
    assert assigned(ex) == ["a0"]  # the second rank stays free rather than go over its limit
    submit(d, "b0", tenant="key-b")
    d.step(0)
    assert assigned(ex) == ["a0", "b0"]
    ex.run("a0")
    d.step(0)
    d.step(0)
    assert assigned(ex) == ["a0", "b0", "a1"]


def test_an_adopted_request_goes_first_past_the_bound_and_counts_as_its_rerun() -> None:
    d, ex, sink, _ = make(queue=1)
    for i in ("a", "b"):
        submit(d, i)
        d.step(0)
    submit(d, "mine")
    with pytest.raises(QueueFull):
        submit(d, "more")
    assert d.adopt("theirs", REQ.compat_key(), REQ) and not d.adopt("theirs", REQ.compat_key(), REQ)
    assert not d.adopt("a", REQ.compat_key(), REQ)  # held here already: its group was only silent
    assert [t.id for t in d.scheduler.queued()] == ["theirs", "mine"]
    ex.kill("g0", "rank 0 died: SIGKILL", rank=0)  # a (the suspect) and b run again, after theirs
    d.step(0)
    d.step(0)
    d.step(0)
    assert [t.id for t in d.scheduler.queued()] == ["b", "mine"]
    assert [j for _, _, j, _ in ex.assigned][-2:] == ["theirs", "a"] and ex.on("theirs") == ("g0", 0)
    ex.kill("g0", "rank 0 died: SIGKILL", rank=0)  # theirs was on its rerun already: it fails; a stood by
    d.step(0)
    assert "2 times" in sink.finished["theirs"].error and "a" not in sink.finished
