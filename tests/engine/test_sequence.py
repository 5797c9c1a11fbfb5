"""D sequence-parallel groups of S actors: placement bundles and groups (no actors started)."""

from __future__ import annotations

from service.engine.group import Engine, EngineSpec


def test_d_sp_groups_of_s_actors() -> None:
    spec = EngineSpec("unused", dp_size=3, sp_size=2, gpus_per_rank=1.0)
    assert spec.bundles() == [{"CPU": 1.0, "GPU": 1.0}] * 6  # one GPU per actor: D x S
    engine = Engine(spec)
    # Each SP group is one scheduler rank (size 1) over S bundles of its own.
    assert [(g.first_bundle, g.size, g.world) for g in engine.groups] == [(0, 1, 2), (2, 1, 2), (4, 1, 2)]
    dp = Engine(EngineSpec("unused", dp_size=2))  # DP AllGather: one group of two ranks, as before
    assert [(g.first_bundle, g.size, g.world) for g in dp.groups] == [(0, 2, 2)]
