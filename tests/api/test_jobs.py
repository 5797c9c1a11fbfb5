"""The job-store actor's lost-group rules, in-process: which jobs of a silent DP group run
again elsewhere (``adopt``), which fail, and that a late answer from the lost group changes
nothing. The reaper is driven by hand (``reap`` after back-dating a heartbeat); the same
through two services is in test_service.py, and through a killed Serve replica in the soak.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.api import jobs
from service.api.jobs import JobStore
from service.api.records import JobRecord, JobStatus


@pytest.fixture
def store(tmp_path: Path) -> Iterator[JobStore]:
    s = JobStore(str(tmp_path), {}, 3600.0, 100, group_timeout_s=30.0)
    try:
        yield s
    finally:
        s.close()


def job(i: int, group: str = "g1", status: str = "queued", model: str = "demo") -> JobRecord:
    return JobRecord(f"video_{i}", 1000 + i, JobStatus(status), model=model, dp_group=group, owner="k")


def silence(s: JobStore, group: str, seconds: float = 60.0) -> None:
    """``group`` last heartbeat ``seconds`` ago (past the store's 30 s timeout)."""
    s._seen[group] = (time.monotonic() - seconds, f"node-of-{group}")


def test_a_lost_groups_jobs_with_their_request_wait_for_another_replica(store: JobStore) -> None:
    store.put(job(1, status="in_progress"), request="req-1")
    store.put(job(2), request="req-2")
    store.put(job(3))  # no request given (--job-retries 0): it cannot run elsewhere
    store.put(job(4, group="g2"), request="req-4")
    store.heartbeat("g2", "node-2")
    silence(store, "g1")
    assert store.reap() == 1
    assert store.get("video_3").error["code"] == "dp_group_lost"
    for i in (1, 2):
        r = store.get(f"video_{i}")
        assert r.status is JobStatus.QUEUED and r.dp_group is None and r.progress == 0
    assert store.status()["groups_lost"][0] | {"at": 0} == {"dp_group": "g1", "node_id": "node-of-g1",
                                                           "failed": 1, "run_again": 2, "at": 0}
    assert sorted(store.heartbeat("g1", "node-of-g1")) == ["video_1", "video_2"]  # if only silent: stop them
    assert store.adopt("g3", "node-3", "another model", 10) == []  # a replica of another model: none
    assert store.adopt("g2", "node-2", "demo", 1) == [("video_1", "req-1", "k")]  # oldest first, up to limit
    assert store.adopt("g2", "node-2", "demo", 5) == [("video_2", "req-2", "k")]
    assert store.adopt("g2", "node-2", "demo", 5) == []  # taken once
    assert {store.get(f"video_{i}").dp_group for i in (1, 2, 4)} == {"g2"}
    assert store.get("video_4").status is JobStatus.QUEUED  # the live group's own job: untouched


def test_only_the_adopting_group_may_end_the_job_and_a_second_loss_fails_it(store: JobStore) -> None:
    store.put(job(1), request="req-1")
    store.put(job(2), request="req-2")
    silence(store, "g1")
    store.reap()
    store.adopt("g2", "node-2", "demo", 5)
    assert store.finish("video_1", by="g1", status=JobStatus.COMPLETED) is None  # the lost group, late
    assert store.get("video_1").status is JobStatus.QUEUED
    assert store.finish("video_1", by="g2", status=JobStatus.COMPLETED).status is JobStatus.COMPLETED
    silence(store, "g2")  # the adopter is lost too: its job ran again once already
    assert store.reap() == 1
    lost = store.get("video_2")
    assert lost.status is JobStatus.FAILED and "DP group g2" in lost.error["message"]


def test_the_silent_group_may_still_complete_a_job_none_took_over(store: JobStore) -> None:
    store.put(job(1), request="req-1")
    silence(store, "g1")
    store.reap()
    assert store.finish("video_1", by="g1", status=JobStatus.COMPLETED).status is JobStatus.COMPLETED
    assert store.adopt("g2", "node-2", "demo", 5) == []


def test_a_job_no_replica_takes_fails_after_the_wait(store: JobStore,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    store.put(job(1), request="req-1")
    silence(store, "g1")
    assert store.reap() == 0
    monkeypatch.setattr(jobs, "ADOPT_WAIT_S", 0.0)
    time.sleep(0.01)
    assert store.reap() == 1
    msg = store.get("video_1").error["message"]
    assert "DP group g1" in msg and "no replica of model 'demo' took it over within 0 s" in msg
    assert store.adopt("g2", "node-2", "demo", 5) == []


def test_a_deleted_orphan_is_not_adopted(store: JobStore) -> None:
    store.put(job(1), request="req-1")
    silence(store, "g1")
    store.reap()
    assert store.delete("video_1")
    assert store.adopt("g2", "node-2", "demo", 5) == []


def test_a_restarted_store_fails_the_jobs_that_waited_for_a_replica(tmp_path: Path) -> None:
    s = JobStore(str(tmp_path), {}, 3600.0, 100, group_timeout_s=30.0)
    s.put(job(1), request="req-1")
    s.put(job(2, group="g2"), request="req-2")
    silence(s, "g1")
    s.reap()
    s.close()
    s._lock_file.close()  # the old process is gone (its folder lock with it)
    again = JobStore(str(tmp_path), {}, 3600.0, 100, group_timeout_s=30.0)
    try:
        assert "job store restarted" in again.get("video_1").error["message"]
        assert again.get("video_2").status is JobStatus.QUEUED  # a live group's: untouched
    finally:
        again.close()


def test_a_job_whose_adoption_is_never_confirmed_is_taken_back(store: JobStore,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``adopt``'s answer lost on the way (a replica's call that timed out after the store gave
    the jobs): no dispatcher holds them, so they go back to the queue instead of waiting as
    ``queued`` under a live group for ever; a confirmed one stays."""
    store.put(job(1), request="req-1")
    store.put(job(2), request="req-2")
    silence(store, "g1")
    store.reap()
    assert [j for j, _, _ in store.adopt("g2", "node-2", "demo", 5)] == ["video_1", "video_2"]
    store.heartbeat("g2", "node-2")
    store.confirm("g2", ["video_2"])
    monkeypatch.setattr(jobs, "CONFIRM_WAIT_S", 0.0)
    time.sleep(0.01)
    store.reap()
    assert store.get("video_1").dp_group is None and store.get("video_1").status is JobStatus.QUEUED
    assert store.get("video_2").dp_group == "g2"
    assert store.heartbeat("g2", "node-2") == ["video_1"]  # should it hold it after all: it stops
    assert store.adopt("g3", "node-3", "demo", 5) == [("video_1", "req-1", "k")]
