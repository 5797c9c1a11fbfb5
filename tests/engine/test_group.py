"""A real DP=2 group of Ray actors on gloo: waves, idle replay, deadlines, rebuilds."""

from __future__ import annotations

import time

import pytest
import ray

from service.engine.group import DPGroup, EngineSpec
from service.models.request import GenerationRequest


@pytest.fixture(scope="module")
def group(ray_cluster: dict, demo_model: str):  # noqa: ANN201
    g = DPGroup(EngineSpec(demo_model, dp_size=2, cpus_per_rank=0.5, pg_timeout_s=60))
    g.start()
    yield g
    g.close()


def calls(g: DPGroup) -> list[int]:
    return [i["calls"] for i in ray.get([a.info.remote() for a in g.actors], timeout=30)]


def test_full_and_partial_waves_match_resident_bytes(group: DPGroup, resident) -> None:  # noqa: ANN001
    reqs = [GenerationRequest(prompt="a red fox", seed=11), GenerationRequest(prompt="a cat", seed=12)]
    seen: list[tuple[int, int, int]] = []
    out = group.run_wave(reqs, deadline_s=120, on_progress=lambda *a: seen.append(a))
    assert [o.dp_rank for o in out] == [0, 1] and all(o.ok for o in out), out
    for req, o in zip(reqs, out, strict=True):
        assert o.mp4 == resident.generate(req)
    before = calls(group)
    lone = group.run_wave(reqs[1:], deadline_s=120)  # rank 1 has nothing: it idle-replays
    assert len(lone) == 1 and lone[0].ok and lone[0].mp4 == out[1].mp4
    assert [c - b for b, c in zip(before, calls(group), strict=True)] == [1, 1]
    assert group.state == "ready"


def test_missed_deadline_fails_the_wave_and_rebuild_recovers(group: DPGroup, resident) -> None:  # noqa: ANN001
    slow = GenerationRequest(prompt="slow", seed=3, num_inference_steps=200)
    gen = group.generation
    t0 = time.monotonic()
    out = group.run_wave([slow], deadline_s=2.0)
    assert time.monotonic() - t0 < 20  # deadline 2 s + poll + kill, with slack for a loaded box
    assert not out[0].ok and "deadline" in out[0].error
    assert group.state == "broken"
    assert group.rebuild("deadline")
    assert group.state == "ready" and group.generation == gen + 1
    req = GenerationRequest(prompt="after rebuild", seed=5)
    again = group.run_wave([req], deadline_s=120)
    assert again[0].ok and again[0].mp4 == resident.generate(req)
