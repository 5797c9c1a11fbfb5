"""Durable files another process may have touched (service/api/durable.py, results.py, the
job store's recovery and ``adopt``, the replica's take-over): real files in a real results
folder, in-process stores and the fake executor, and once the store as a real Ray actor.

- a malformed ``<id>.req`` or ``<id>.json`` (a field no request has, JSON nested past the
  parser's depth, a FIFO, a link, an oversize file) never stops a start: that job fails with
  a reason naming its file, every other job runs again;
- a ``<id>.state`` is used only for its own job and request, and only with the latents'
  shape and dtype the model makes for that request: any other reruns from step 0, as does a
  state of a model that cannot go on from one; one unreadable state strands no other job;
- a restart on another model says which model its jobs wait for; a revoked key's job does
  not run again.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from service.api import jobs
from service.api.durable import request_digest, state_bytes
from service.api.jobs import JobStore
from service.api.keys import key_hash, owner_id
from service.api.records import JobRecord, JobStatus
from service.api.results import ResultStorage, UnusableFile
from service.api.service import ServiceConfig, VideoService
from service.models.request import GenerationRequest
from service.models.resume import StepState
from tests.fakes import FakeExecutor

REQ = GenerationRequest(prompt="a red fox", seed=1, num_inference_steps=4)  # latents (1, 16, 2, 4, 4)
DEEP = b"[" * 200_000 + b"]" * 200_000  # json.loads: RecursionError


def until(cond: Callable[[], object], timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.02)


def crashed(folder: Path, model: str, reqs: dict[str, GenerationRequest], owner: str | None = None) -> None:
    """``folder`` as an instance killed while these jobs ran (their group's node gone) left it."""
    store = JobStore(str(folder), {}, 3600.0, 100, 30.0)
    for i, (job_id, req) in enumerate(reqs.items()):
        store.put(JobRecord(job_id, 1000 + i, JobStatus.IN_PROGRESS, model=model, dp_group="gone",
                            node_id="node-gone", owner=owner), request=req)
    store.close()
    store._lock_file.close()  # what the kernel does for a killed process


def started(folder: Path, timeout: float = 60.0) -> JobStore:
    """A store started on ``folder``, in a thread: a start that blocks (a FIFO read) fails here."""
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(JobStore(str(folder), {}, 3600.0, 100, 30.0)), daemon=True)
    t.start()
    t.join(timeout)
    assert box, "the store did not start"
    return box[0]


def state(job_id: str, req: GenerationRequest, shape: tuple[int, ...] = (1, 16, 2, 4, 4),
          dtype: torch.dtype = torch.float32, step: int = 2, loop: bool = True) -> bytes:
    """A whole state file of ``job_id`` for ``req`` (its header says so) with these latents
    and (``loop``) a loop state as models/loop.py takes it."""
    n = 1
    for d in shape:
        n *= abs(d)
    tree = {"scheduler": {"_step_index": step}, "hooks": {}, "generator": torch.Generator().get_state()}
    latents = torch.full((n,), 2.0, dtype=dtype)
    st = StepState.of(step, req.num_inference_steps, latents, tree if loop else None)
    st = StepState(st.step, st.total, st.dtype, shape, st.data, st.loop, st.blobs)
    return state_bytes(st, job_id, request_digest(req))


def test_a_malformed_durable_file_fails_its_job_naming_it_and_never_stops_a_start(tmp_path: Path) -> None:
    names = ("video_resume", "video_deep", "video_fifo", "video_link", "video_big", "video_ok")
    crashed(tmp_path, "demo", {n: REQ for n in names})
    req = (tmp_path / "video_ok.req").read_bytes()
    (tmp_path / "video_resume.req").write_bytes(req.replace(b'"priority"', b'"resume": {}, "priority"'))
    (tmp_path / "video_deep.req").write_bytes(DEEP)
    (tmp_path / "video_fifo.req").unlink()
    os.mkfifo(tmp_path / "video_fifo.req")
    (tmp_path / "elsewhere").write_bytes(req)
    (tmp_path / "video_link.req").unlink()
    (tmp_path / "video_link.req").symlink_to(tmp_path / "elsewhere")
    with open(tmp_path / "video_big.req", "wb") as f:  # sparse: no disk, a size past the cap
        f.truncate(1 << 30)
    os.mkfifo(tmp_path / "video_pipe.json")  # a FIFO named like a record
    (tmp_path / "video_nest.json").write_bytes(DEEP)
    store = started(tmp_path)
    try:
        assert store.get("video_ok").status is JobStatus.QUEUED and store._requests["video_ok"] == REQ
        for name in names[:-1]:
            rec = store.get(name)
            assert rec.status is JobStatus.FAILED, rec
            assert f"{name}.req" in rec.error["message"], rec.error  # the reason names the file
        assert "resume" in store.get("video_resume").error["message"]
        assert "RecursionError" in store.get("video_deep").error["message"]
        assert "not a regular file" in store.get("video_fifo").error["message"]
        assert store.get("video_pipe") is None and store.get("video_nest") is None
    finally:
        store.close()


def test_a_store_actor_starts_on_a_folder_with_a_fifo_and_a_deep_record(ray_cluster: dict,
                                                                         tmp_path: Path) -> None:
    """The store as it runs (a Ray actor, its constructor the recovery): it answers."""
    from service.api.config import ServiceConfig
    from service.api.jobs import connect_store, stop_store

    crashed(tmp_path, "demo", {"video_ok": REQ})
    os.mkfifo(tmp_path / "video_pipe.json")
    (tmp_path / "video_nest.req").write_bytes(DEEP)
    (tmp_path / "video_nest.json").write_bytes(DEEP)
    url = str(tmp_path)
    try:
        cfg = ServiceConfig()  # the settings' defaults are its fields'
        client = connect_store(url, None, retention_s=cfg.retention_s, max_jobs=cfg.max_jobs,
                               group_timeout_s=cfg.group_timeout_s)
        assert client.status()["unfinished"] == 1 and client.get("video_ok").status is JobStatus.QUEUED
    finally:
        stop_store(url)


def test_files_are_read_capped_never_through_a_link_or_a_fifo(tmp_path: Path) -> None:
    storage = ResultStorage(str(tmp_path))
    (tmp_path / "a.state").write_bytes(b"x" * 10)
    assert storage.read_capped("a.state", 10) == b"x" * 10 and storage.read_capped("none.state", 10) is None
    with pytest.raises(UnusableFile, match="over 9"):
        storage.read_capped("a.state", 9)
    with open(tmp_path / "sparse", "wb") as f:
        f.truncate(3 << 29)  # 1.5 GiB, no disk
    (tmp_path / "b.state").symlink_to(tmp_path / "sparse")
    with pytest.raises(UnusableFile, match="b.state"):
        storage.read_capped("b.state", 1 << 31)  # a link: refused unopened, whatever its target
    os.mkfifo(tmp_path / "c.json")
    with pytest.raises(UnusableFile, match="not a regular file"):
        storage.read_capped("c.json", 100)
    (tmp_path / "d.json").symlink_to(tmp_path / "e")
    (tmp_path / "e").write_text('{"id": "video_e", "created_at": 1}')
    assert storage.read_records() == []  # the link is not read; the FIFO does not block


def test_one_unreadable_state_strands_no_other_job(tmp_path: Path) -> None:
    crashed(tmp_path, "demo", {"video_1": REQ, "video_2": REQ, "video_3": REQ})
    (tmp_path / "video_1.state").write_bytes(state("video_1", REQ))
    (tmp_path / "video_2.state").write_bytes(DEEP[:4000] + b"\n")  # a header nested past the parser
    os.mkfifo(tmp_path / "video_3.state")
    store = started(tmp_path)
    try:
        taken = store.adopt("g2", "node-2", "demo", 10)
        assert [(j, r.resume is not None) for j, r, _ in taken] == [
            ("video_1", True), ("video_2", False), ("video_3", False)]
        assert [store.get(j).dp_group for j, _, _ in taken] == ["g2"] * 3
        assert store.get("video_1").resumable_step == 2 and store.get("video_2").resumable_step == 0
    finally:
        store.close()


@pytest.fixture
def service_after(euler_model: str, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Start a replica (fake executor) and its store on the folder a crash left."""
    made: list[tuple[VideoService, JobStore]] = []

    def start(model: str = euler_model, **cfg: Any) -> tuple[VideoService, FakeExecutor, JobStore]:
        ex = FakeExecutor((1,))
        store = started(tmp_path)
        cfg = ServiceConfig(model=model, results_url=str(tmp_path), **cfg)
        svc = VideoService(cfg, executor=ex, store=store, node_id="node-new")
        made.append((svc, store))
        return svc, ex, store

    yield start
    for svc, store in made:
        svc.close()
        store.close()


def run_all(ex: FakeExecutor, ids: list[str]) -> dict[str, Any]:
    """Run every job of ``ids`` as the fake rank gets it; what each was handed."""
    handed: dict[str, Any] = {}
    while len(handed) < len(ids):
        until(lambda: any(a[2] in ids and a[2] not in handed for a in ex.assigned))
        job_id, req = next((a[2], a[3]) for a in ex.assigned if a[2] in ids and a[2] not in handed)
        handed[job_id] = req
        ex.run(job_id)
    return handed


def test_a_state_is_used_only_for_its_own_job_request_shape_and_dtype(service_after: Any,
                                                                      tmp_path: Path) -> None:
    wide = GenerationRequest(prompt="a red fox", seed=1, num_inference_steps=4, height=32, width=64)
    reqs = {"video_own": REQ, "video_swapped": wide, "video_batch": REQ, "video_negative": REQ,
            "video_half": REQ, "video_foreign": REQ, "video_changed": REQ, "video_bigger": REQ}
    crashed(tmp_path, "model", reqs)
    files = {
        "video_own": state("video_own", REQ),
        "video_swapped": state("video_swapped", wide, (1, 16, 2, 8, 4)),  # H and W swapped
        "video_batch": state("video_batch", REQ, (2, 16, 2, 4, 4)),  # twice the work
        "video_negative": state("video_negative", REQ, (1, 16, 2, -4, -4)),  # a positive product
        "video_half": state("video_half", REQ, dtype=torch.float16),
        "video_foreign": state("video_own", REQ),  # another tenant's job's state, copied
        "video_changed": state("video_changed", GenerationRequest(prompt="another", num_inference_steps=4)),
        "video_bigger": state("video_bigger", REQ, (1, 16, 2, 8, 8)),  # 4x the pixels
    }
    for job_id, data in files.items():
        (tmp_path / f"{job_id}.state").write_bytes(data)
    svc, ex, store = service_after()
    handed = run_all(ex, list(reqs))
    assert handed["video_own"].resume is not None and handed["video_own"].resume.step == 2
    for job_id in list(reqs)[1:]:
        assert handed[job_id].resume is None, job_id  # from step 0, never the bigger work
    until(lambda: all(store.get(j).status is JobStatus.COMPLETED for j in reqs))


def test_a_state_the_model_cannot_go_on_from_reruns_from_step_0(demo_model: str, tmp_path: Path,
                                                               service_after: Any) -> None:
    """A state without the loop's (an older release's file: UniPC's history is not in it) is
    no head start."""
    crashed(tmp_path, Path(demo_model).name, {"video_unipc": REQ})
    (tmp_path / "video_unipc.state").write_bytes(state("video_unipc", REQ, loop=False))
    svc, ex, store = service_after(demo_model)
    handed = run_all(ex, ["video_unipc"])
    assert handed["video_unipc"].resume is None
    until(lambda: store.get("video_unipc").status is JobStatus.COMPLETED)
    assert store.get("video_unipc").resumable_step == 0


def test_a_revoked_keys_job_does_not_run_again(service_after: Any, tmp_path: Path) -> None:
    kept, gone = key_hash("sk-kept"), key_hash("sk-gone")
    crashed(tmp_path, "model", {"video_gone": REQ}, owner=owner_id(gone))
    svc, ex, store = service_after(api_key_hashes=[kept])
    until(lambda: store.get("video_gone").final)
    assert store.get("video_gone").error["code"] == "key_revoked" and ex.assigned == []


def test_a_restart_on_another_model_says_which_model_its_jobs_wait_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    crashed(tmp_path, "wan-a", {"video_1": REQ})
    store = started(tmp_path)
    try:
        assert store.adopt("g2", "node-2", "wan-b", 10) == []  # a replica of the new model asks
        monkeypatch.setattr(jobs, "ADOPT_WAIT_S", 0.0)  # (its wait over)
        until(lambda: store.get("video_1").final)
        message = store.get("video_1").error["message"]
        assert "'wan-a'" in message and "'wan-b'" in message, message
    finally:
        store.close()
