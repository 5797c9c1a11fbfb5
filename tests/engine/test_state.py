"""A rank hands each step's state off on its STEP events, and a rerun it is given goes on
from one (one in-process rank, the "tiny" demo preset, named: Wan's UniPC; real diffusers):

- a resumable request's rank emits a STEP with the state after every step but the last,
  the latents of that step (the ones the pipeline's callback saw);
- given the request resumed from step k, the rank makes only the forwards of the n - k
  steps left (the tick protocol's count) and the MP4 bytes equal the full run's;
- its STARTED event says why no state is kept where none is ("" where one is).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from service.engine.events import Event, EventKind
from service.engine.rank import RankWorker
from service.models.demo import ensure_demo_model
from service.models.pipeline import PipelineRunner
from service.models.request import GenerationRequest

REQ = GenerationRequest(prompt="kept", seed=11, num_inference_steps=4)  # CFG: 8 forwards


@pytest.fixture(scope="module")
def worker() -> Iterator[RankWorker]:
    runner = PipelineRunner.load(str(ensure_demo_model("tiny")), "cpu", config=None)
    w = RankWorker(runner)
    yield w
    w.close()
    runner.close()


def run(worker: RankWorker, job: str, req: GenerationRequest) -> tuple[Event, list[Event]]:
    """Serve ``req`` to its end; its FINISHED and every event the rank said meanwhile."""
    seen: list[Event] = []
    done = threading.Event()

    def pump() -> None:
        while not done.is_set():
            for e in worker.events(0.5):
                seen.append(e)
                if e.kind is EventKind.FINISHED and e.job_id == job:
                    done.set()

    worker.assign(job, req)
    t = threading.Thread(target=pump, daemon=True)
    t.start()
    worker.serve()
    assert done.wait(120)
    t.join()
    return next(e for e in seen if e.kind is EventKind.FINISHED), seen


def test_states_go_out_on_step_events_and_a_resumed_rerun_is_exact(worker: RankWorker) -> None:
    f0, taken = worker.forwards, worker.status()["states"]  # the worker is the module's: counts go on
    full, seen = run(worker, "full", REQ)
    assert full.mp4 and worker.forwards - f0 == REQ.forwards() == 8
    states = [e.state for e in seen if e.kind is EventKind.STEP and e.state is not None]
    assert [s.step for s in states] == [1, 2, 3] and all(s.total == 4 for s in states)
    progress = [e.step for e in seen if e.kind is EventKind.STEP and e.state is None and e.preview is None]
    assert progress == [1, 2, 3, 4]
    assert worker.status()["states"] - taken == 3
    for st in (states[0], states[2]):
        f0 = worker.forwards
        again, later = run(worker, f"from{st.step}", REQ.resumed(st))
        assert again.mp4 == full.mp4
        assert worker.forwards - f0 == (4 - st.step) * 2
        assert [e.state.step for e in later if e.state is not None] == list(range(st.step + 1, 4))


def test_the_start_says_why_no_state_is_kept(worker: RankWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request the family cannot resume (sequence parallel needs two processes: its rule
    is stood in for) starts with the reason, and hands no state out."""
    req = GenerationRequest(prompt="not kept", seed=12, num_inference_steps=2)
    _, seen = run(worker, "kept", req)
    assert [e.not_resumable for e in seen if e.kind is EventKind.STARTED] == [""]
    monkeypatch.setattr(worker.runner.adapter, "resume_blocker", lambda r: "sequence parallel runs are not "
                        "resumed yet")
    _, seen = run(worker, "unkept", req)
    assert [e.not_resumable for e in seen if e.kind is EventKind.STARTED] == ["sequence parallel runs are "
                                                                              "not resumed yet"]
    assert not [e for e in seen if e.state is not None]
