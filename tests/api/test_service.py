"""VideoService on the fake executor and an in-process job store: the job lifecycle, cancel,
admission while no group can serve, drain. No Ray; each test well under a second of work.

The same paths through real HTTP and real rank actors are in test_http.py and test_security.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.api.jobs import JobStore
from service.api.records import JobStatus
from service.api.service import ServiceConfig, VideoService, video_object
from service.router.dispatcher import Unavailable
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
    ex.run(running.id)  # ends while the drain waits for it
    out = svc.drain(timeout_s=10, reason="service stopped")
    assert out["queued_failed"] == 1 and out["running_failed"] == 0
    assert status(svc, queued.id) is JobStatus.FAILED and status(svc, running.id) is JobStatus.COMPLETED
    assert "service stopped" in svc.store.get(queued.id).error["message"]
