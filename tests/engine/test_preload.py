"""A standby loads ahead (engine.preload): only where its group is one process, at background
priority. The e2e half (a standby that takes over loaded) is in tests/engine/test_standby.py."""

from __future__ import annotations

from service.config import EngineConfig, OffloadConfig, OffloadMode, ParallelConfig
from service.engine.preload import Preload, preloadable
from service.models.request import GenerationRequest


def config(mode: OffloadMode, dp: int = 1, sp: int = 1, preload: bool = True) -> EngineConfig:
    return EngineConfig("unused", offload=OffloadConfig(mode),
                        parallel=ParallelConfig(dp_size=dp, sp_size=sp, rank_standby_preload=preload))


def test_only_one_process_groups_load_ahead() -> None:
    assert preloadable(config(OffloadMode.AUTO))  # one group: its rank decides auto at the load
    assert preloadable(config(OffloadMode.ALLGATHER))  # DP1: gathers nothing, no process group
    assert preloadable(config(OffloadMode.RANK_LOCAL, dp=2))
    assert preloadable(config(OffloadMode.RESIDENT, dp=2))
    assert not preloadable(config(OffloadMode.ALLGATHER, dp=2))  # shards over its process group
    assert not preloadable(config(OffloadMode.AUTO, dp=2))  # may become one AllGather group
    assert not preloadable(config(OffloadMode.ALLGATHER, sp=2))
    assert not preloadable(config(OffloadMode.RANK_LOCAL, preload=False))  # --no-rank-standby-preload


def test_a_load_ahead_is_taken_once(demo_model: str) -> None:
    spec = EngineConfig(demo_model, offload=OffloadConfig(OffloadMode.RANK_LOCAL),
                        parallel=ParallelConfig(encoders_per_rank=2))
    kept = Preload(spec)
    got = kept.take()
    assert got is not None and got.seconds > 0 and got.config == spec
    req = GenerationRequest(prompt="loaded ahead", seed=1, num_inference_steps=2, height=32, width=32,
                            num_frames=5)
    assert got.runner.generate(req)[4:8] == b"ftyp"  # a usable pipeline: an MP4
    got.runner.close()
    assert kept.take() is None  # taken once


def test_a_failed_load_ahead_leaves_the_load_to_set_up(tmp_path) -> None:  # noqa: ANN001
    p = Preload(EngineConfig(str(tmp_path / "missing"), offload=OffloadConfig(OffloadMode.RANK_LOCAL)))
    assert p.take() is None and "the load ahead failed" in (p.problem or "")


def test_a_standby_loads_ahead_below_the_serving_threads(demo_model: str) -> None:
    """A standby's load ahead runs niced (engine.priority), below the serving rank's threads."""
    import os
    import threading

    from service.engine.priority import BACKGROUND_NICE

    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    spec = EngineConfig(demo_model, offload=OffloadConfig(OffloadMode.RANK_LOCAL))
    p = Preload(spec)
    assert p.wait()
    assert p.nice == min(19, base + BACKGROUND_NICE) != base
    p.close()
