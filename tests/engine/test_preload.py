"""A waiting rank process loads ahead (engine.preload): only where its group is one process,
used only for the config it was loaded for, and each bundle adopts the pre-started process
that loads on the bundle's GPU. The e2e halves (a standby that takes over loaded, pre-started
ranks adopted loaded) are in tests/engine/test_standby.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from service.config import EngineConfig, OffloadConfig, OffloadMode, ParallelConfig
from service.engine.preload import Preload, preloadable
from service.engine.ray_executor import RayExecutor
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


def test_a_load_ahead_is_used_for_its_own_config_only(demo_model: str) -> None:
    spec = EngineConfig(demo_model, offload=OffloadConfig(OffloadMode.RANK_LOCAL),
                        parallel=ParallelConfig(encoders_per_rank=2))
    other = replace(spec, model=replace(spec.model, dtype="bfloat16"))
    dropped = Preload(spec, standby=True)
    assert dropped.take(other) is None and "another config" in (dropped.problem or "")

    kept = Preload(spec, standby=True)
    # the encoder count is the launcher's to size: it does not make the config another
    got = kept.take(replace(spec, parallel=replace(spec.parallel, encoders_per_rank=None)))
    assert got is not None and got.seconds > 0 and got.config == spec
    req = GenerationRequest(prompt="loaded ahead", seed=1, num_inference_steps=2, height=32, width=32,
                            num_frames=5)
    assert got.runner.generate(req)[4:8] == b"ftyp"  # a usable pipeline: an MP4
    got.runner.close()
    assert kept.take(spec) is None  # taken once


def test_a_failed_load_ahead_leaves_the_load_to_set_up(tmp_path) -> None:  # noqa: ANN001
    p = Preload(EngineConfig(str(tmp_path / "missing"), offload=OffloadConfig(OffloadMode.RANK_LOCAL)),
                standby=True)
    assert p.take(p.config) is None and "the load ahead failed" in (p.problem or "")


def test_a_standby_loads_ahead_below_the_serving_threads(demo_model: str) -> None:
    """A standby's load ahead runs niced (engine.priority); a pre-started rank's does not."""
    import os
    import threading

    from service.engine.priority import BACKGROUND_NICE

    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    spec = EngineConfig(demo_model, offload=OffloadConfig(OffloadMode.RANK_LOCAL))
    for standby, want in ((True, min(19, base + BACKGROUND_NICE)), (False, base)):
        p = Preload(spec, standby=standby)
        assert p.wait()
        assert p.nice == want
        p.close()


def test_each_bundle_adopts_the_process_loading_on_its_gpu() -> None:
    spec = replace(config(OffloadMode.RANK_LOCAL, dp=3), parallel=ParallelConfig(dp_size=3, gpus_per_rank=1))
    ex = RayExecutor(spec, prestarted=["p0", "p1", "p2"])
    ex._prestart_gpus = {0: "4", 1: "5", 2: "6"}  # what each answered (the launcher saw GPUs 4,5,6)
    # a bundle given GPU 6 takes the process loading on GPU 6, whatever its index
    assert [ex._prestart_key(b, d) for b, d in [(0, "6"), (1, "4"), (2, "5")]] == [2, 0, 1]
    assert ex._prestart_key(1, None) == 1 and ex._prestart_key(1, "4,5") == 1  # CPU; several GPUs
    assert ex._prestart_key(1, "7") == 1  # a GPU no process took: the bundle's own
    ex._prestarted.pop(2)
    assert ex._prestart_key(0, "6") == 0  # that process was adopted already


def test_pre_started_processes_take_the_gpus_the_launcher_sees() -> None:
    from service.engine.standby import prestart_gpus

    two = EngineConfig("unused", parallel=ParallelConfig(dp_size=2, gpus_per_rank=1))
    assert prestart_gpus(two, None) == ["0", "1"]
    assert prestart_gpus(two, "4, 6,7") == ["4", "6"]  # Ray names the GPUs by these ids
    assert prestart_gpus(replace(two, parallel=replace(two.parallel, gpus_per_rank=0.5)), None) == []
    assert prestart_gpus(EngineConfig("unused"), "0") == []  # CPU ranks


def test_a_one_gpu_cluster_names_its_bundles_gpu_without_a_task(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundle of a one-GPU cluster can only have that GPU: the pre-started process on it
    named it, so no task (a new worker process) asks Ray. Anything else still asks."""
    import ray

    spec = replace(config(OffloadMode.RANK_LOCAL), parallel=ParallelConfig(dp_size=1, gpus_per_rank=1))
    ex = RayExecutor(spec, prestarted=["p0"])
    ex._prestart_gpus = {0: "3"}
    gpus = {"GPU": 1.0}  # this machine has no GPU: Ray's count as a one-GPU node reports it
    monkeypatch.setattr(ray, "cluster_resources", lambda: dict(gpus))
    assert ex._only_gpu() == "3" and ex._bundle_devices([0]) == ["3"]
    gpus["GPU"] = 2.0
    assert ex._only_gpu() is None
    gpus["GPU"] = 1.0
    ex._prestart_gpus = {0: None}  # the process did not answer: ask Ray
    assert ex._only_gpu() is None
