"""The engine config: group layouts (D SP groups of S processes, one AllGather group of N, N
single ranks), the CPUs a rank gets, standbys."""

from __future__ import annotations

import pytest

from service.config import EngineConfig, OffloadConfig, OffloadMode, ParallelConfig


def test_d_sp_groups_of_s_processes() -> None:
    spec = EngineConfig("unused", parallel=ParallelConfig(dp_size=3, sp_size=2, gpus_per_rank=1.0))
    assert spec.parallel.bundles() == [{"CPU": 1.0, "GPU": 1.0}] * 6  # one GPU per process: D x S
    # Each SP group is one scheduler rank (size 1) over S bundles of its own.
    assert spec.group_layout() == [(0, 1), (2, 1), (4, 1)]


@pytest.mark.parametrize(("mode", "layout"), [
    (OffloadMode.ALLGATHER, [(0, 2)]),  # one group of two ranks that gather from each other
    (OffloadMode.RANK_LOCAL, [(0, 1), (1, 1)]),  # no collectives: each rank is its own group
    (OffloadMode.RESIDENT, [(0, 1), (1, 1)]),
])
def test_dp_layouts(mode: OffloadMode, layout: list[tuple[int, int]]) -> None:
    spec = EngineConfig("unused", parallel=ParallelConfig(dp_size=2), offload=OffloadConfig(mode))
    assert spec.group_layout() == layout and spec.collective == (mode is OffloadMode.ALLGATHER)


def test_auto_must_be_resolved_before_a_layout() -> None:
    with pytest.raises(ValueError, match="resolve --dlo-mode auto"):
        EngineConfig("unused", parallel=ParallelConfig(dp_size=2),
                     offload=OffloadConfig(OffloadMode.AUTO)).group_layout()


def test_host_sized_cpus_per_rank() -> None:
    """A node of ours shares its CPUs (less the ingress's) among its ranks, whole CPUs, never
    below the old default of 1: a 2-core host places DP2 as before; a 16-core H200 host gives
    one rank 14 CPUs (three 4-thread encoders instead of one)."""
    from service.config.parallel import CPUS_PER_RANK, INGRESS_CPUS, host_cpus_per_rank
    from service.engine.encoder import pool_size

    assert host_cpus_per_rank(2, 2)[0] == CPUS_PER_RANK == 1.0
    value, why = host_cpus_per_rank(16, 1)
    assert value == 16 - INGRESS_CPUS and "16 CPUs" in why and "--cpus-per-rank" in why
    assert pool_size(value) == 3 and pool_size(CPUS_PER_RANK) == 1
    assert host_cpus_per_rank(32, 2)[0] == 15 and host_cpus_per_rank(16, 3)[0] == 4
    assert host_cpus_per_rank(0.5, 4)[0] == 1.0


def test_rank_standby_is_on_by_default_with_gpus_and_the_flag_decides() -> None:
    import argparse

    from service.api.serve_flags import add_arguments, config_from_args
    from service.jobs import batch

    p = argparse.ArgumentParser()
    add_arguments(p)
    flags = ["/m", "--cpus-per-rank", "1"]
    assert config_from_args(p.parse_args(flags), gpus_per_rank=1.0).engine_config().parallel.use_standby
    assert not config_from_args(p.parse_args(flags), gpus_per_rank=0.0).engine_config().parallel.use_standby
    on = config_from_args(p.parse_args([*flags, "--rank-standby"]), gpus_per_rank=0.0)
    assert on.rank_standby and on.engine_config().parallel.use_standby
    off = config_from_args(p.parse_args([*flags, "--no-rank-standby"]), gpus_per_rank=1.0)
    assert off.rank_standby is False and not off.engine_config().parallel.use_standby
    assert on.engine_config().parallel.rank_standby_preload  # standbys load while they wait, by default
    cold = config_from_args(p.parse_args([*flags, "--no-rank-standby-preload"]), gpus_per_rank=1.0)
    assert not cold.engine_config().parallel.rank_standby_preload
    bp = batch.parser()
    assert bp.parse_args(["--prompts", "p", "--out", "o"]).rank_standby is None
    assert not bp.parse_args(["--prompts", "p", "--out", "o", "--no-rank-standby"]).rank_standby
