"""Group layouts: D SP groups of S processes, one AllGather group of N, N single ranks."""

from __future__ import annotations

import pytest

from service.engine.spec import EngineSpec
from service.models.options import Mode, OffloadSettings


def test_d_sp_groups_of_s_processes() -> None:
    spec = EngineSpec("unused", dp_size=3, sp_size=2, gpus_per_rank=1.0)
    assert spec.bundles() == [{"CPU": 1.0, "GPU": 1.0}] * 6  # one GPU per process: D x S
    # Each SP group is one scheduler rank (size 1) over S bundles of its own.
    assert spec.group_layout() == [(0, 1), (2, 1), (4, 1)]


@pytest.mark.parametrize(("mode", "layout"), [
    (Mode.ALLGATHER, [(0, 2)]),  # one group of two ranks that gather from each other
    (Mode.RANK_LOCAL, [(0, 1), (1, 1)]),  # no collectives: each rank is its own group
    (Mode.RESIDENT, [(0, 1), (1, 1)]),
])
def test_dp_layouts(mode: Mode, layout: list[tuple[int, int]]) -> None:
    spec = EngineSpec("unused", dp_size=2, settings=OffloadSettings(mode))
    assert spec.group_layout() == layout and spec.collective == (mode is Mode.ALLGATHER)


def test_auto_must_be_resolved_before_a_layout() -> None:
    with pytest.raises(ValueError, match="resolve --dlo-mode auto"):
        EngineSpec("unused", dp_size=2, settings=OffloadSettings(Mode.AUTO)).group_layout()
