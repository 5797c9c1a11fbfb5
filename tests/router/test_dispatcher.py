"""The dispatcher on real Ray rank groups (gloo, demo model): who fails when a rank dies.

- rank-local DP2, continuous: every rank is its own group. Killing rank 1 while it runs a
  request fails that request only; rank 0's request completes, rank 1 alone is rebuilt
  and the queue goes on.
- AllGather DP2, waves: a wave takes requests of one key only; a request past its
  deadline fails with the reason, the group is rebuilt, the next request is exact.
The AllGather continuous case (a dead rank fails everything the group held) is tested
through HTTP in tests/api/test_http.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from service.engine.group import Engine, EngineSpec, Outcome
from service.models.request import GenerationRequest
from service.router.dispatcher import Dispatcher
from service.router.policy import DeadlinePolicy
from service.router.waves import Ticket


class Collect:
    """A Sink that remembers everything and lets a test wait for a request's end."""

    def __init__(self) -> None:
        self.started: dict[str, dict[str, Any]] = {}
        self.finished: dict[str, Outcome] = {}
        self.progress: dict[str, int] = {}
        self._cv = threading.Condition()

    def on_start(self, ticket: Ticket, info: dict[str, Any]) -> None:
        with self._cv:
            self.started[ticket.id] = dict(info)

    def on_progress(self, ticket_id: str, step: int, total: int) -> None:
        with self._cv:
            self.progress[ticket_id] = step
            self._cv.notify_all()

    def on_finish(self, ticket: Ticket, outcome: Outcome, info: dict[str, Any]) -> None:
        with self._cv:
            self.finished[ticket.id] = outcome
            self._cv.notify_all()

    def wait(self, ids: list[str], timeout: float = 120) -> list[Outcome]:
        with self._cv:
            assert self._cv.wait_for(lambda: all(i in self.finished for i in ids), timeout), self.finished
            return [self.finished[i] for i in ids]

    def wait_progress(self, tid: str, timeout: float = 60) -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: self.progress.get(tid, 0) >= 1, timeout)


def submit(d: Dispatcher, tid: str, req: GenerationRequest) -> None:
    d.submit(tid, req.compat_key(), req)


def wait_ready(d: Dispatcher, timeout: float = 180) -> None:
    end = time.monotonic() + timeout
    while d.engine.status()["state"] != "ready":
        assert time.monotonic() < end, d.engine.status()
        time.sleep(0.1)


def running(spec: EngineSpec, **kw: object) -> Iterator[tuple[Dispatcher, Collect]]:
    """A started dispatcher over ``spec``'s groups, ready; stopped afterwards."""
    sink = Collect()
    d = Dispatcher(Engine(spec), sink, **kw)
    d.start()
    try:
        wait_ready(d)
        yield d, sink
    finally:
        d.stop()


@pytest.fixture
def ranklocal(ray_cluster: dict, demo_model: str) -> Iterator[tuple[Dispatcher, Collect]]:
    spec = EngineSpec(demo_model, dp_size=2, use_allgather=False, cpus_per_rank=0.5, pg_timeout_s=60,
                      encoders_per_rank=0)
    yield from running(spec, scheduler="continuous", deadlines=DeadlinePolicy(base_s=120))


def test_ranklocal_dead_rank_fails_only_its_own_request(ranklocal, resident) -> None:  # noqa: ANN001
    d, sink = ranklocal
    assert [g.size for g in d.engine.groups] == [1, 1]
    a = GenerationRequest(prompt="stays", seed=1, num_inference_steps=30)
    b = GenerationRequest(prompt="doomed", seed=2, num_inference_steps=400)
    c = GenerationRequest(prompt="queued", seed=3)
    submit(d, "a", a)
    submit(d, "b", b)
    sink.wait_progress("b")
    submit(d, "c", c)
    victim = d.engine.groups[sink.started["b"]["rank"]]
    survivor = d.engine.groups[sink.started["a"]["rank"]]
    gen = survivor.generation
    ray.kill(victim.actors[0])
    out_b = sink.wait(["b"])[0]
    assert not out_b.ok and f"rank {victim.first_bundle} died" in out_b.error
    out_a, out_c = sink.wait(["a", "c"])
    assert out_a.ok and out_a.mp4 == resident.generate(a)
    assert out_c.ok and out_c.mp4 == resident.generate(c)
    assert survivor.generation == gen  # the other rank was never touched
    wait_ready(d)
    assert victim.generation >= 1 and victim.rebuilds == 1


@pytest.fixture
def waves(ray_cluster: dict, demo_model: str) -> Iterator[tuple[Dispatcher, Collect]]:
    spec = EngineSpec(demo_model, dp_size=2, cpus_per_rank=0.5, pg_timeout_s=60, encoders_per_rank=1)
    yield from running(spec, scheduler="waves", max_wait_s=0.5,
                       deadlines=DeadlinePolicy(base_s=5.0, per_forward_s=0.004))


def test_waves_hold_one_key_and_a_missed_deadline_rebuilds(waves, resident) -> None:  # noqa: ANN001
    d, sink = waves
    x1 = GenerationRequest(prompt="x1", seed=1)
    x2 = GenerationRequest(prompt="x2", seed=2, guidance_scale=3.0)  # same key: CFG on
    y = GenerationRequest(prompt="y", seed=3, num_frames=9)
    for tid, req in (("x1", x1), ("y", y), ("x2", x2)):
        submit(d, tid, req)
    outs = sink.wait(["x1", "x2", "y"])
    assert all(o.ok for o in outs), outs
    assert [o.mp4 for o in outs] == [resident.generate(r) for r in (x1, x2, y)]
    info = {t: sink.started[t] for t in ("x1", "x2", "y")}
    assert info["x1"]["wave"] == info["x2"]["wave"] != info["y"]["wave"]
    assert info["x1"]["size"] == info["x2"]["size"] == 2 and info["y"]["size"] == 1
    assert {info["x1"]["rank"], info["x2"]["rank"]} == {0, 1}

    gen = d.engine.groups[0].generation
    slow = GenerationRequest(prompt="slow", seed=4, num_inference_steps=1000)  # ~20 s; deadline 13 s
    t0 = time.monotonic()
    submit(d, "slow", slow)
    out = sink.wait(["slow"], timeout=60)[0]
    assert not out.ok and "deadline" in out.error, out
    assert time.monotonic() - t0 < 13 + 15  # the deadline, then the poll and the kill
    wait_ready(d)
    assert d.engine.groups[0].generation == gen + 1
    after = GenerationRequest(prompt="after the rebuild", seed=5)
    submit(d, "after", after)
    assert sink.wait(["after"])[0].mp4 == resident.generate(after)
