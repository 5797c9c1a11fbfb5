"""A results storage that refuses writes: 507 before any work, not ready, counted, recovered.

Real failed writes (tests/api/test_results.py ``small_disk``: a full 600 KiB tmpfs where this
process may mount one, else RLIMIT_FSIZE); the service runs on the fake executor and an
in-process job store, whose record writes are the ones that fail.
"""

from __future__ import annotations

import errno
import json
import time
from pathlib import Path

import pytest

from service.api import storage_health
from service.api.jobs import JobStore
from service.api.results import StorageError
from service.api.service import ServiceConfig, VideoService
from tests.api.test_results import small_disk
from tests.fakes import FakeExecutor

BODY = {"prompt": "a red fox", "seed": 1, "num_inference_steps": 2}


def until(cond, timeout: float = 30.0) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met"
        time.sleep(0.05)


def test_a_full_disk_refuses_jobs_before_work_and_turns_readyz_not_ready(
        demo_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.api.app import _CREATE_ERRORS

    monkeypatch.setattr(storage_health, "PROBE_EVERY_S", 0.0)
    with small_disk(tmp_path) as disk:
        folder = disk.folder
        ex = FakeExecutor((1,), {})
        store = JobStore(str(folder), {}, 3600.0, 100, 30.0)
        svc = VideoService(ServiceConfig(model=demo_model, results_url=str(folder)), executor=ex, store=store,
                           node_id="node-1")
        try:
            assert svc.readiness()["ready"]
            disk.fill()
            with pytest.raises(StorageError) as e:  # the job's record does not fit
                svc.create(dict(BODY))
            assert e.value.errno == disk.errno
            assert store.list() == [] and svc.dispatcher.depth == 0 and not ex.assigned  # no job half-made
            ready = svc.readiness()
            assert not ready["ready"] and ready["storage"]["ok"] is False, ready
            assert ready["storage"]["errno"] in ("ENOSPC", "EFBIG") and "full" in ready["storage"]["error"]
            with pytest.raises(StorageError, match="refused until it takes writes again"):
                svc.create(dict(BODY))  # at once, without trying the disk again
            assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]
            disk.make_room()
            until(lambda: svc.readiness()["ready"])  # the heartbeat's probe write went through
            assert svc.readiness()["storage"] == {"ok": True}
            rec = svc.create(dict(BODY))
            assert json.loads((folder / f"{rec.id}.json").read_text())["status"] == "queued"
        finally:
            svc.close()
            store.close()
    assert 507 in _CREATE_ERRORS


@pytest.mark.e2e
def test_a_full_results_disk_over_http(app_url: str, demo_model: str, tmp_path: Path) -> None:
    """Served (real Serve, the job-store actor writing to a full 600 KiB tmpfs): POST is a 507
    in the API's error shape with Retry-After (it was a plain-text 500), /readyz 503 naming
    the errno, no temp file left; room again: ready, and a job completes. Needs a tmpfs mount
    (root): the store writes in another process, where RLIMIT_FSIZE of this one cannot reach."""
    import httpx
    from ray import serve

    from service.api.app import build_app
    from tests.api.conftest import wait_final, wait_ready

    with small_disk(tmp_path) as disk:
        if disk.errno != errno.ENOSPC:
            pytest.skip("no tmpfs mount here (not root): covered without HTTP by the test above")
        cfg = ServiceConfig(model=demo_model, data_parallel_size=1, cpus_per_rank=0.25, encoders_per_rank=0,
                            results_url=str(disk.folder), pg_timeout_s=60)
        serve.run(build_app(cfg.model_dump()), name="fulldisk", route_prefix="/fulldisk")
        url = f"{app_url}/fulldisk"
        try:
            wait_ready(url, 180)
            disk.fill()
            r = httpx.post(f"{url}/v1/videos", json=BODY, timeout=30)
            assert r.status_code == 507 and r.headers["retry-after"].isdigit(), r.text
            err = r.json()["error"]
            assert err["code"] == "storage_full" and "No space left" in err["message"], err
            ready = httpx.get(f"{url}/readyz", timeout=10)
            assert ready.status_code == 503 and ready.json()["storage"]["errno"] == "ENOSPC", ready.text
            assert not [p.name for p in disk.folder.iterdir() if p.name.endswith(".tmp")]
            disk.make_room()
            wait_ready(url, 60)
            r = httpx.post(f"{url}/v1/videos", json=BODY, timeout=30)
            assert r.status_code == 202, r.text
            assert wait_final(url, r.json()["id"])["status"] == "completed"
        finally:
            serve.delete("fulldisk")
