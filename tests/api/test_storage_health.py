"""A results storage that refuses writes: 507 before any work, not ready, counted, recovered.

Real failed writes (tests/api/test_results.py ``small_disk``: a full 600 KiB tmpfs where this
process may mount one, else RLIMIT_FSIZE); the service runs on the fake executor and an
in-process job store, whose record writes are the ones that fail.
"""

from __future__ import annotations

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
