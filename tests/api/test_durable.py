"""Jobs that outlive a restart (service/api/durable.py, the job store's recovery): fake
executors and in-process stores on a real results folder; the same with `dloserve serve`
SIGKILLed and started again is tests/api/test_restart_e2e.py (e2e).

- a request and a state go to files and come back equal; a torn, foreign or out-of-range
  file reads as nothing (the job then reruns from 0, or fails with a reason);
- a replica keeps its running job's state in the results folder, 0600, at most one write
  per interval, at once when the job is paused, never after its end;
- a store started on the folder of a crashed instance shows every unfinished job
  ``queued`` at once; a replica takes them over, the one with a state goes on from its step,
  and their files go when they end; a job whose request is torn fails with the reason, and
  a state file of no job is swept;
- a replica closed without a drain (deleted, or SIGTERMed by the watchdog after ``serve``
  was SIGKILLed) ends none of its jobs: the store takes them back and another replica runs
  them, the running one from its step.
"""

from __future__ import annotations

import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path

import torch

from service.api.durable import StateKeeper, request_bytes, request_digest, request_of, state_bytes, state_of
from service.api.jobs import JobStore
from service.api.records import JobStatus
from service.api.results import ResultStorage
from service.api.service import ServiceConfig, VideoService, video_object
from service.config.cache import CacheSpec
from service.models.lora_ref import LoraRef
from service.models.request import GenerationRequest
from service.models.resume import StepState
from tests.fakes import FakeExecutor

BODY = {"prompt": "a red fox", "seed": 1, "num_inference_steps": 4}


# what models/loop.py takes, in small
LOOP = {"scheduler": {"_step_index": 2, "model_outputs": [None, torch.ones(1, 16, 2, 1, 3)]}}


def until(cond: Callable[[], object], timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.02)


def test_a_request_and_a_state_come_back_equal_and_bad_files_read_as_nothing() -> None:
    req = GenerationRequest(prompt="fox", seed=9, num_inference_steps=4, image=b"\x89PNG...", priority=-2,
                            loras=(LoraRef("fast", 0.5, "both", "/l/fast.safetensors", "ab" * 32),),
                            cache=CacheSpec("first_block", threshold=0.1), extra={"max_sequence_length": 64})
    back = request_of(request_bytes(req))
    assert back == req and back.image == req.image and back.priority == -2
    assert request_digest(back) == request_digest(req)  # a state written before a restart is its state after
    state = StepState.of(2, 4, torch.arange(2 * 16 * 3, dtype=torch.bfloat16).reshape(1, 16, 2, 1, 3), LOOP)
    raw = state_bytes(state, "video_a", request_digest(req))
    again = state_of(raw, req, "video_a")
    assert again is not None and again.step == 2 and torch.equal(again.tensor(), state.tensor())
    kept = again.loop_tree()["scheduler"]
    assert kept["_step_index"] == 2
    assert torch.equal(kept["model_outputs"][1], LOOP["scheduler"]["model_outputs"][1])
    assert state_of(raw[:-1], req, "video_a") is None  # torn
    assert state_of(raw + b"\0", req, "video_a") is None  # bytes no tensor claims
    bare = state_bytes(StepState.of(2, 4, state.tensor()), "video_a", request_digest(req))
    assert state_of(bare, req, "video_a") is None  # no loop state (an older release's file)
    eight = GenerationRequest(prompt="fox", num_inference_steps=8)
    assert state_of(state_bytes(state, "video_a", request_digest(eight)), eight, "video_a") is None  # steps
    assert state_of(b"{}\n", req, "video_a") is None and state_of(None, req, "video_a") is None
    assert request_of(b"not json") is None and request_of(None) is None
    assert request_of(request_bytes(req).replace(b'"priority": -2', b'"priority": -200')) is None


def test_a_replica_keeps_states_privately_once_per_interval_and_never_after_the_end(tmp_path: Path) -> None:
    storage = ResultStorage(str(tmp_path))
    keeper = StateKeeper(storage, every_s=10.0)
    req = GenerationRequest(prompt="p", num_inference_steps=4)
    keeper.track("video_a", req)
    st = [StepState.of(k, 4, torch.full((1, 16, 1, 2, 2), float(k)), LOOP) for k in (1, 2, 3)]
    keeper.offer("video_a", st[0])
    assert keeper.write_due(now=100.0) == 1
    path = tmp_path / "video_a.state"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    keeper.offer("video_a", st[1])
    assert keeper.write_due(now=105.0) == 0  # within the interval: the latest waits
    keeper.urgent("video_a")  # paused: now
    assert keeper.write_due(now=106.0) == 1
    assert state_of(path.read_bytes(), req, "video_a").step == 2
    keeper.offer("video_a", st[2])
    keeper.forget("video_a")  # its end is being stored
    assert keeper.write_due(now=200.0) == 0


def service_on(folder: Path, model: str, node: str) -> tuple[VideoService, FakeExecutor, JobStore]:
    ex = FakeExecutor((1,))
    store = JobStore(str(folder), {}, 3600.0, 100, 30.0)
    svc = VideoService(ServiceConfig(model=model, results_url=str(folder)), executor=ex, store=store,
                       node_id=node)
    return svc, ex, store


def test_a_restart_on_the_folder_runs_unfinished_jobs_again_from_their_steps(euler_model: str,
                                                                              tmp_path: Path) -> None:
    first, after = tmp_path / "first", tmp_path / "after"
    svc, ex, store = service_on(first, euler_model, "node-old")
    try:
        running = svc.create(dict(BODY))
        queued = svc.create({**BODY, "seed": 2})
        ex.wait_assigned(running.id)
        ex.hand_off(running.id, StepState.of(2, 4, torch.full((1, 16, 2, 4, 4), 2.0), LOOP))
        until(lambda: (first / f"{running.id}.state").exists())
        until(lambda: store.get(running.id).status is JobStatus.IN_PROGRESS)
        shutil.copytree(first, after, ignore=shutil.ignore_patterns(".lock"))  # the folder as a crash left it
    finally:
        svc.close()
        store.close()
    svc, ex, store = service_on(after, euler_model, "node-new")
    try:
        for job in (running, queued):  # queued at once, held by no group until one takes it
            rec = store.get(job.id)
            assert rec.status is JobStatus.QUEUED and rec.dp_group in (None, svc.dp_group), rec
        ex.wait_assigned(running.id)  # one rank: the other waits its turn
        assert video_object(store.get(running.id))["resumable_step"] == 2  # the state written
        again = [a[3] for a in ex.assigned if a[2] == running.id][-1]
        assert again.resume is not None and again.resume.step == 2 and again.seed == 1
        until(lambda: store.get(running.id).status is JobStatus.IN_PROGRESS)
        assert video_object(store.get(running.id))["resumed_from_step"] == 2
        assert video_object(store.get(queued.id))["resumable_step"] == 0  # never handed a state off
        ex.run(running.id)
        ex.wait_assigned(queued.id)
        assert [a[3] for a in ex.assigned if a[2] == queued.id][-1].resume is None  # no state: from 0
        ex.run(queued.id)
        until(lambda: all(store.get(j.id).status is JobStatus.COMPLETED for j in (running, queued)))
        until(lambda: not list(after.glob("*.req")) and not list(after.glob("*.state")))
    finally:
        svc.close()
        store.close()


def test_a_job_whose_request_cannot_be_read_fails_with_the_reason_after_a_restart(demo_model: str,
                                                                                  tmp_path: Path) -> None:
    first, after = tmp_path / "first", tmp_path / "after"
    svc, ex, store = service_on(first, demo_model, "node-old")
    try:
        rec = svc.create(dict(BODY))
        ex.wait_assigned(rec.id)
        until(lambda: store.get(rec.id).status is JobStatus.IN_PROGRESS)
        shutil.copytree(first, after, ignore=shutil.ignore_patterns(".lock"))
    finally:
        svc.close()
        store.close()
    (after / f"{rec.id}.req").write_bytes(b"torn")
    (after / "video_gone.state").write_bytes(b"a late write of a job that ended")
    again = JobStore(str(after), {}, 3600.0, 100, 0.5)  # its group stays silent: the reaper fails it
    try:
        until(lambda: again.get(rec.id).final, timeout=30)
        assert again.get(rec.id).error["code"] == "dp_group_lost"
        assert not (after / "video_gone.state").exists()  # swept at the start: no job of its own
    finally:
        again.close()


def test_a_replica_closed_without_a_drain_leaves_its_jobs_to_the_store(euler_model: str,
                                                                        tmp_path: Path) -> None:
    # A group silent for 4 s is lost: four of its 1 s heartbeats missed. At 0.5 s a heartbeat late
    # on a loaded host let the store take the running job back before the close (1 run of 6).
    store = JobStore(str(tmp_path), {}, 3600.0, 100, 4.0)
    config = ServiceConfig(model=euler_model, results_url=str(tmp_path))
    ex, ex2 = FakeExecutor((1,)), FakeExecutor((1,))
    first = VideoService(config, executor=ex, store=store, node_id="node")
    second = None
    try:
        running = first.create(dict(BODY))
        queued = first.create({**BODY, "seed": 2})
        ex.wait_assigned(running.id)
        ex.hand_off(running.id, StepState.of(2, 4, torch.full((1, 16, 2, 4, 4), 2.0), LOOP))
        until(lambda: (tmp_path / f"{running.id}.state").exists())
        first.close()  # what a Ray actor's __del__ does on SIGTERM
        for job, status in ((running, JobStatus.IN_PROGRESS), (queued, JobStatus.QUEUED)):
            assert store.get(job.id).status is status, store.get(job.id)  # not failed "service stopped"
        second = VideoService(config, executor=ex2, store=store, node_id="node")
        ex2.wait_assigned(running.id, timeout=60)  # once the first group is lost
        again = [a[3] for a in ex2.assigned if a[2] == running.id][-1]
        assert again.resume is not None and again.resume.step == 2
        ex2.run(running.id)
        ex2.wait_assigned(queued.id)
        ex2.run(queued.id)
        until(lambda: all(store.get(j.id).status is JobStatus.COMPLETED for j in (running, queued)))
    finally:
        first.close()  # (again: a no-op)
        if second is not None:
            second.close()
        store.close()
