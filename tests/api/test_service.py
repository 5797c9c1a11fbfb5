"""VideoService on the fake executor and an in-process job store: the job lifecycle, cancel,
admission while no group can serve, drain. No Ray; each test well under a second of work.

The same paths through real HTTP and real rank actors are in test_http.py and test_security.py.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.api.jobs import JobStore
from service.api.records import JobStatus
from service.api.service import ServiceConfig, VideoService, video_object
from service.router.health import Unavailable
from tests.fakes import FakeExecutor

BODY = {"prompt": "a red fox", "seed": 1, "num_inference_steps": 2}


def until(cond: Any, timeout: float = 10.0) -> None:
    """Wait for the service's own threads (the dispatcher, the finisher) to get there."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.01)


@pytest.fixture
def service(demo_model: str, tmp_path: Path,
            request: pytest.FixtureRequest) -> Iterator[tuple[VideoService, FakeExecutor]]:
    outcomes = getattr(request, "param", {})
    ex = FakeExecutor((1,), outcomes)
    store = JobStore(str(tmp_path), {}, 3600.0, 100, 30.0)
    cfg = ServiceConfig(model=demo_model, results_url=str(tmp_path))
    svc = VideoService(cfg, executor=ex, store=store, node_id="node-1")
    try:
        yield svc, ex
    finally:
        svc.close()
        store.close()


def status(svc: VideoService, job_id: str) -> JobStatus:
    rec = svc.store.get(job_id)
    return rec.status if rec else None  # type: ignore[return-value]


def test_a_job_runs_to_completed_with_its_mp4_and_timings(service) -> None:  # noqa: ANN001
    svc, ex = service
    rec = svc.create(dict(BODY))
    assert rec.status is JobStatus.QUEUED and rec.owner is None and rec.node_id == "node-1"
    ex.wait_assigned(rec.id)
    until(lambda: status(svc, rec.id) is JobStatus.IN_PROGRESS)
    ex.run(rec.id)
    until(lambda: status(svc, rec.id) is JobStatus.COMPLETED)
    done = svc.store.get(rec.id)
    assert svc.storage.video_path(rec.id).read_bytes() == f"mp4 of {rec.id}".encode()
    assert set(done.timings) >= {"queue_s", "text_encode_s", "denoise_s", "step_s", "decode_s", "encode_s",
                                 "store_s"}
    public = video_object(done)
    assert public["timings"]["denoise_s"] == 0.5 and "owner" not in public and public["progress"] == 100


def test_delete_cancels_a_running_job_then_removes_it(service) -> None:  # noqa: ANN001
    svc, ex = service
    running, queued = svc.create(dict(BODY)), svc.create(dict(BODY))
    ex.wait_assigned(running.id)
    assert svc.delete(queued.id) == "deleted" and svc.store.get(queued.id) is None
    assert svc.delete(running.id) == "cancelling"
    ex.wait_cancelled(running.id)
    ex.run(running.id, cancelled=True)
    until(lambda: status(svc, running.id) is JobStatus.CANCELLED)
    assert svc.store.get(running.id).error["code"] == "cancelled"
    assert video_object(svc.store.get(running.id))["status"] == "cancelled"
    assert svc.delete(running.id) == "deleted" and svc.delete(running.id) == "missing"


@pytest.mark.parametrize("service", [{0: [False, False, False, False, False, False]}], indirect=True)
def test_with_no_group_able_to_start_new_jobs_get_503_and_readiness_says_down(service) -> None:  # noqa: ANN001
    svc, ex = service
    until(lambda: svc.readiness()["state"] == "down")
    with pytest.raises(Unavailable) as e:
        svc.create(dict(BODY))
    assert e.value.retry_after_s >= 1 and "attempt" in str(e.value)
    r = svc.readiness()
    assert not r["ready"] and r["availability"] == "down" and "attempt" in r["last_error"]


def test_drain_fails_queued_jobs_and_lets_running_ones_finish(service) -> None:  # noqa: ANN001
    svc, ex = service
    running, queued = svc.create(dict(BODY)), svc.create(dict(BODY))
    ex.wait_assigned(running.id)
    # The running job ends only once the drain has failed the queued one: had it ended first,
    # its freed rank could take the queued job before the drain (a race this test once lost).
    out: dict = {}
    drain = threading.Thread(target=lambda: out.update(svc.drain(timeout_s=10, reason="service stopped")))
    drain.start()
    deadline = time.monotonic() + 10
    while status(svc, queued.id) is not JobStatus.FAILED and time.monotonic() < deadline:
        time.sleep(0.01)
    ex.run(running.id)  # ends while the drain waits for it
    drain.join(15)
    assert out["queued_failed"] == 1 and out["running_failed"] == 0
    assert status(svc, queued.id) is JobStatus.FAILED and status(svc, running.id) is JobStatus.COMPLETED
    assert "service stopped" in svc.store.get(queued.id).error["message"]


# -- many tenants: quotas, fair share, nothing of one key's reaches another ----------------
KEY_A, KEY_B = "sk-a-0123456789", "sk-b-9876543210"
ADMIN = "sk-admin-55555"


@pytest.fixture
def keyed(demo_model: str, tmp_path: Path,
          request: pytest.FixtureRequest) -> Iterator[tuple[VideoService, FakeExecutor]]:
    """Two API keys and an admin key on one AllGather group of two fake ranks."""
    from service.api.keys import key_hash

    ex = FakeExecutor((2,))
    store = JobStore(str(tmp_path), {}, 3600.0, 100, 30.0)
    cfg = ServiceConfig(model=demo_model, results_url=str(tmp_path), data_parallel_size=2,
                        api_key_hashes=[key_hash(KEY_A), key_hash(KEY_B)], admin_key_hashes=[key_hash(ADMIN)],
                        **getattr(request, "param", {}))
    svc = VideoService(cfg, executor=ex, store=store, node_id="node-1")
    try:
        yield svc, ex
    finally:
        svc.close()
        store.close()


def owner(svc: VideoService, key: str) -> str | None:
    return svc.owner_of(f"Bearer {key}")


@pytest.mark.parametrize("keyed", [{"max_queued_per_key": 3, "key_quotas": {}}], indirect=True)
def test_one_key_floods_its_own_quota_and_the_other_keys_first_job_runs_next(keyed) -> None:  # noqa: ANN001
    from service.router.tenants import QuotaExceeded

    svc, ex = keyed
    a, b = owner(svc, KEY_A), owner(svc, KEY_B)
    first = [svc.create(dict(BODY), a) for _ in range(2)]
    for rec in first:
        ex.wait_assigned(rec.id)
    queued = [svc.create(dict(BODY), a) for _ in range(3)]
    with pytest.raises(QuotaExceeded) as e:
        svc.create(dict(BODY), a)
    assert e.value.retry_after_s >= 1 and e.value.limit == 3
    mine = svc.create(dict(BODY), b)  # key-b is not refused for key-a's queue
    ex.run(first[0].id)  # the first rank to free goes to key-b, ahead of key-a's older three
    assert ex.wait_assigned(mine.id) == ex.on(first[0].id)
    assert not any(q.id in {j for _, _, j, _ in ex.assigned} for q in queued)
    # its rank took mine as soon as its forwards were done; it stops counting as running
    # once its end is in (the fake reports the two in separate batches)
    until(lambda: status(svc, first[0].id) is JobStatus.COMPLETED)
    yours = svc.readiness_for(svc.caller(f"Bearer {KEY_A}"))["yours"]
    assert yours == {"queued": 3, "running": 1, "max_queued": 3, "max_running": None, "min_priority": 0}


MISSED = {"wave_deadline_base_s": 0.2, "wave_deadline_per_forward_s": 0.0}


@pytest.mark.parametrize("keyed", [MISSED], indirect=True)
def test_a_missed_deadline_fails_both_keys_jobs_and_neither_names_the_other(keyed) -> None:  # noqa: ANN001
    svc, ex = keyed
    a, b = owner(svc, KEY_A), owner(svc, KEY_B)
    ra, rb = svc.create(dict(BODY), a), svc.create(dict(BODY), b)
    ex.wait_assigned(ra.id)
    ex.wait_assigned(rb.id)
    until(lambda: status(svc, ra.id) is JobStatus.FAILED and status(svc, rb.id) is JobStatus.FAILED)
    for mine, other, who in ((ra, rb, a), (rb, ra, b)):
        err = svc.get(mine.id, who).error["message"]
        assert "deadline" in err and other.id not in err, err
        waves = svc.waves(svc.caller(f"Bearer {KEY_A if who == a else KEY_B}"))
        # the one whose deadline passed first fails; the other runs again (a wave record each
        # run) until its own deadline passes (the fake ranks never finish): both fail
        assert waves and all(w["ids"] == [mine.id] for w in waves) and other.id not in str(waves)
        assert all("wave" not in w and "tenant" not in w for w in waves)
        assert "wave" not in video_object(svc.get(mine.id, who))  # the global wave number is gone


@pytest.mark.parametrize("keyed", [{"job_retries": 0}], indirect=True)  # both fail (no rerun)
def test_a_group_failure_that_quotes_one_job_names_it_to_no_other_key(keyed) -> None:  # noqa: ANN001
    svc, ex = keyed
    a, b = owner(svc, KEY_A), owner(svc, KEY_B)
    ra, rb = svc.create(dict(BODY), a), svc.create(dict(BODY), b)
    ex.wait_assigned(ra.id)
    ex.wait_assigned(rb.id)
    ex.kill("g0", f"rank 0 failed: RuntimeError: CUDA error while running {ra.id}")
    until(lambda: status(svc, ra.id) is JobStatus.FAILED and status(svc, rb.id) is JobStatus.FAILED)
    assert ra.id in svc.get(ra.id, a).error["message"]  # its own id stays: it is the caller's
    err_b = svc.get(rb.id, b).error["message"]
    assert ra.id not in err_b and "another request" in err_b and "CUDA error" in err_b
    everything = svc.waves(svc.caller(f"Bearer {ADMIN}"))  # the operator sees every record
    assert {w["ids"][0] for w in everything} == {ra.id, rb.id} and all("tenant" in w for w in everything)
    assert svc.waves(svc.caller(None)) == []  # no key: nobody's records (the route answers 401)


def test_readyz_tells_an_anonymous_caller_ready_or_not_and_a_key_only_its_own_counts(keyed) -> None:  # noqa: ANN001
    svc, ex = keyed
    until(lambda: svc.readiness()["ready"])
    svc.create(dict(BODY), owner(svc, KEY_A))
    anonymous = svc.readiness_for(svc.caller(None))
    assert anonymous == {"ready": True, "instance": None}
    assert svc.readiness_for(svc.caller("Bearer sk-wrong")) == anonymous
    tenant = svc.readiness_for(svc.caller(f"Bearer {KEY_B}"))
    private = ("model_dir", "results_url", "node_id", "workers", "queue_depth", "in_flight", "waves_run")
    assert not set(private) & set(tenant), tenant
    assert tenant["state"] == "ready" and tenant["yours"]["queued"] == 0 and tenant["groups"]
    admin = svc.readiness_for(svc.caller(f"Bearer {ADMIN}"))
    assert {"model_dir", "results_url", "node_id", "queue_depth", "in_flight"} <= set(admin)


def test_a_lost_replicas_jobs_run_again_on_another_and_its_late_answer_changes_nothing(
        demo_model: str, tmp_path: Path) -> None:
    store = JobStore(str(tmp_path), {}, 3600.0, 100, 2.0)  # a group silent 2 s is lost
    cfg = ServiceConfig(model=demo_model, results_url=str(tmp_path))
    ex_a, ex_b = FakeExecutor((1,)), FakeExecutor((1,))
    a = VideoService(cfg, executor=ex_a, store=store, node_id="node-a", dp_group="ga")
    b = VideoService(cfg, executor=ex_b, store=store, node_id="node-b", dp_group="gb")
    try:
        held, queued = a.create(dict(BODY)), a.create({**BODY, "seed": 2})
        ex_a.wait_assigned(held.id)
        a.heartbeat.stop()  # a's heartbeat stops, as when its process is gone; its rank still holds `held`
        until(lambda: ex_b.on(held.id) if held.id in ex_b._where else False, timeout=30)
        assert store.get(queued.id).dp_group == "gb"  # both taken over, the held one first
        ex_b.run(held.id)
        ex_b.wait_assigned(queued.id)
        ex_b.run(queued.id)
        until(lambda: status(b, queued.id) is JobStatus.COMPLETED)
        assert b.storage.video_path(held.id).read_bytes() == f"mp4 of {held.id}".encode()
        lost = store.status()["groups_lost"]
        assert [(g["dp_group"], g["failed"], g["run_again"]) for g in lost] == [("ga", 0, 2)]
        ex_a.run(held.id, mp4=b"late")  # the lost replica answers after all: refused, nothing removed
        time.sleep(0.5)
        assert status(b, held.id) is JobStatus.COMPLETED and store.get(held.id).dp_group == "gb"
        assert b.storage.video_path(held.id).read_bytes() == f"mp4 of {held.id}".encode()
    finally:
        b.close()
        a.close()
        store.close()


class StoreView:
    """A replica's view of the store, every call passed through; subclasses slow one down."""

    def __init__(self, store: JobStore) -> None:
        self.store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


class SlowTakeOver(StoreView):
    """The store as one replica sees it when taking jobs over is slow (their states and records
    read and rewritten on a slow bucket): ``adopt`` returns ``delay_s`` after it handed them over."""

    def __init__(self, store: JobStore, delay_s: float) -> None:
        super().__init__(store)
        self.delay_s = delay_s

    def adopt(self, *args: Any, **kwargs: Any) -> list:
        taken = self.store.adopt(*args, **kwargs)
        if taken:
            time.sleep(self.delay_s)
        return taken


def test_a_slow_take_over_does_not_make_the_taking_group_look_lost(demo_model: str, tmp_path: Path) -> None:
    """The group that takes a lost group's jobs over keeps beating while it does: taking them
    for longer than the store's timeout fails none of them (make multinode, 2026-12-05: its
    beat waited behind a 2.7 s take-over and the jobs failed as lost a second time)."""
    store = JobStore(str(tmp_path), {}, 3600.0, 100, 4.0)  # a group silent 4 s is lost (the beat: 1 s)
    cfg = ServiceConfig(model=demo_model, results_url=str(tmp_path))
    ex_a, ex_b = FakeExecutor((1,)), FakeExecutor((1,))
    a = VideoService(cfg, executor=ex_a, store=store, node_id="node-a", dp_group="ga")
    b = VideoService(cfg, executor=ex_b, store=SlowTakeOver(store, 7.0), node_id="node-b",  # type: ignore[arg-type]
                     dp_group="gb")
    try:
        job = a.create(dict(BODY))
        ex_a.wait_assigned(job.id)
        a.heartbeat.stop()
        until(lambda: ex_b.on(job.id) if job.id in ex_b._where else False, timeout=30)
        ex_b.run(job.id)
        until(lambda: store.get(job.id).final)
        assert status(b, job.id) is JobStatus.COMPLETED, store.get(job.id).error
        assert [g["dp_group"] for g in store.status()["groups_lost"]] == ["ga"]
    finally:
        b.close()
        a.close()
        store.close()


class HeldWrites(StoreView):
    """The store as a replica sees it when record writes hang (a slow bucket): ``update`` waits
    for ``release`` once ``hold`` is set."""

    def __init__(self, store: JobStore) -> None:
        super().__init__(store)
        self.hold, self.release, self.waiting = threading.Event(), threading.Event(), 0

    def update(self, *args: Any, **kwargs: Any) -> Any:
        if self.hold.is_set():
            self.waiting += 1
            self.release.wait(60)
        return self.store.update(*args, **kwargs)


def test_a_hanging_status_write_holds_neither_admission_nor_the_job(demo_model: str, tmp_path: Path) -> None:
    """The dispatcher writes a job's start holding the lock that admission takes: while that
    write hangs, a POST is still answered, and once it lands the job ends completed."""
    store = JobStore(str(tmp_path), {}, 3600.0, 100, 30.0)
    held = HeldWrites(store)
    ex = FakeExecutor((1,))
    svc = VideoService(ServiceConfig(model=demo_model, results_url=str(tmp_path)), executor=ex,
                       store=held, node_id="node-1")  # type: ignore[arg-type]
    try:
        held.hold.set()
        first = svc.create(dict(BODY))
        ex.wait_assigned(first.id)
        until(lambda: held.waiting > 0)  # its start's write hangs
        answered: list[Any] = []
        t = threading.Thread(target=lambda: answered.append(svc.create({**BODY, "seed": 2})), daemon=True)
        t.start()
        t.join(30)  # a bound on a hang, not a measurement
        assert answered, "a POST waited for another job's status write"
        held.release.set()
        ex.run(first.id)
        until(lambda: status(svc, first.id) is JobStatus.COMPLETED)
        assert store.get(first.id).status is JobStatus.COMPLETED
    finally:
        held.release.set()
        svc.close()
        store.close()


def test_readyz_says_how_the_ranks_were_sized(service) -> None:  # noqa: ANN001
    svc, _ = service
    assert svc.readiness()["cpus_per_rank"] == {"value": 1.0, "why": "set"}


def test_a_restart_without_keys_keeps_every_keys_jobs_private(demo_model: str, tmp_path: Path) -> None:
    """The key file missing after a redeploy: the keyed jobs in the results folder are no
    anonymous caller's to list, read or delete; and results are the service user's only."""
    from service.api.keys import key_hash

    folder = tmp_path / "results"
    cfg = ServiceConfig(model=demo_model, results_url=str(folder), api_key_hashes=[key_hash(KEY_A)])
    store = JobStore(str(folder), {}, 3600.0, 100, 30.0)
    ex = FakeExecutor((1,))
    svc = VideoService(cfg, executor=ex, store=store, node_id="node-1")
    rec = svc.create(dict(BODY), owner(svc, KEY_A))
    ex.wait_assigned(rec.id)
    ex.run(rec.id)
    until(lambda: status(svc, rec.id) is JobStatus.COMPLETED)
    svc.close()
    store.close()
    store._lock_file.close()  # the first instance has stopped: its lock goes with it
    assert folder.stat().st_mode & 0o777 == 0o700
    assert {f.stat().st_mode & 0o777 for f in folder.glob(f"{rec.id}.*")} == {0o600}

    store = JobStore(str(folder), {}, 3600.0, 100, 30.0)  # the same folder, no keys now
    svc = VideoService(ServiceConfig(model=demo_model, results_url=str(folder)), executor=FakeExecutor((1,)),
                       store=store, node_id="node-1")
    try:
        assert svc.store.get(rec.id) is not None  # still there, still its key's
        assert svc.get(rec.id, None) is None
        assert svc.delete(rec.id, None) == "missing"
        mine = svc.create(dict(BODY))
        listed, _ = svc.list(None, 100, "desc", None)
        assert [r.id for r in listed] == [mine.id]
        assert svc.get(mine.id, None) is not None
    finally:
        svc.close()
        store.close()


def test_a_job_whose_rank_keeps_no_state_says_why(service) -> None:  # noqa: ANN001
    svc, ex = service
    rec = svc.create(dict(BODY))
    ex.wait_assigned(rec.id)
    assert video_object(svc.store.get(rec.id))["not_resumable"] == ""
    why = "sequence parallel runs are not resumed yet"
    ex.begin(rec.id, not_resumable=why)
    until(lambda: video_object(svc.store.get(rec.id))["not_resumable"] == why)
    ex.run(rec.id)
    until(lambda: status(svc, rec.id) is JobStatus.COMPLETED)
    assert video_object(svc.store.get(rec.id))["not_resumable"] == why


def test_a_rerun_that_goes_on_from_a_step_says_so(service) -> None:  # noqa: ANN001
    import torch

    from service.models.resume import StepState

    svc, ex = service
    rec = svc.create(dict(BODY))
    ex.wait_assigned(rec.id)
    until(lambda: status(svc, rec.id) is JobStatus.IN_PROGRESS)
    assert video_object(svc.store.get(rec.id))["resumed_from_step"] == 0
    assert video_object(svc.store.get(rec.id))["resumable_step"] == 0
    ex.hand_off(rec.id, StepState.of(1, 2, torch.zeros(1, 16, 2, 4, 4)))
    # The video says which step the service keeps once it does (the heartbeat sends it).
    until(lambda: video_object(svc.store.get(rec.id))["resumable_step"] == 1)
    ex.kill("g0")  # its rank died: it runs again, from step 1
    until(lambda: sum(a[2] == rec.id for a in ex.assigned) == 2)
    assert [a[3] for a in ex.assigned][-1].resume.step == 1
    assert video_object(svc.store.get(rec.id))["resumable_step"] == 1  # queued again: still kept
    until(lambda: status(svc, rec.id) is JobStatus.IN_PROGRESS)
    ex.run(rec.id)
    until(lambda: status(svc, rec.id) is JobStatus.COMPLETED)
    assert video_object(svc.store.get(rec.id))["resumed_from_step"] == 1


# -- priorities: a key's floor, and a paused job's video object -----------------------------
@pytest.mark.parametrize("keyed", [{"key_quotas": {hashlib.sha256(KEY_B.encode()).hexdigest(): {
    "min_priority": -5}}}], indirect=True)  # the key file's min_priority=-5 for key-b
def test_a_key_cannot_ask_past_its_priority_floor(keyed) -> None:  # noqa: ANN001
    from service.api.errors import BodyError

    svc, _ = keyed
    a = owner(svc, KEY_A)
    for bad in (-1, -100):  # better than the default floor of a key (0)
        with pytest.raises(BodyError) as e:
            svc.create({**BODY, "priority": bad}, a)
        assert e.value.field == "priority" and "floor is 0" in str(e.value)
    with pytest.raises(BodyError) as e:
        svc.create({**BODY, "priority": 101}, a)
    assert e.value.field == "priority"
    assert video_object(svc.create({**BODY, "priority": 7}, a))["priority"] == 7
    assert video_object(svc.create(dict(BODY), a))["priority"] == 0
    b = owner(svc, KEY_B)
    assert video_object(svc.create({**BODY, "priority": -5}, b))["priority"] == -5
    with pytest.raises(BodyError):
        svc.create({**BODY, "priority": -6}, b)


def test_an_open_service_takes_any_priority_in_range(service) -> None:  # noqa: ANN001
    from service.api.errors import BodyError

    svc, _ = service
    assert svc.create({**BODY, "priority": -100}).priority == -100
    with pytest.raises(BodyError) as e:
        svc.create({**BODY, "priority": True})
    assert e.value.field == "priority"


def test_a_paused_job_shows_its_preemptions_and_completes(service) -> None:  # noqa: ANN001
    import torch

    from service.models.resume import StepState

    svc, ex = service
    slow = svc.create({**BODY, "priority": 5})
    ex.wait_assigned(slow.id)
    ex.hand_off(slow.id, StepState.of(1, 2, torch.zeros(1, 16, 2, 4, 4)))
    until(lambda: status(svc, slow.id) is JobStatus.IN_PROGRESS)
    urgent = svc.create({**BODY, "priority": 0})
    ex.wait_cancelled(slow.id)  # paused at its next forward
    ex.finish(slow.id, cancelled=True)
    ex.wait_assigned(urgent.id)
    until(lambda: video_object(svc.store.get(slow.id))["preemptions"] == 1)
    assert status(svc, slow.id) is JobStatus.QUEUED
    ex.run(urgent.id)
    until(lambda: sum(a[2] == slow.id for a in ex.assigned) == 2)
    assert [a[3] for a in ex.assigned][-1].resume.step == 1
    ex.run(slow.id)
    until(lambda: status(svc, slow.id) is JobStatus.COMPLETED)
    v = video_object(svc.store.get(slow.id))
    assert (v["priority"], v["preemptions"], v["resumed_from_step"]) == (5, 1, 1)
    assert status(svc, urgent.id) is JobStatus.COMPLETED
