"""The encoder pool's size follows the CPUs a rank is given; the flag, when given, wins.

x264's thread count is fixed (``X264_THREADS``: the bytes depend on it), so what adapts to
the host is how many encodes run at once: about cpus // X264_THREADS, at least one.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from service.engine.encoder import Encoder, pool_size, rank_cpus
from service.models.video import X264_THREADS, encode_mp4


@pytest.mark.parametrize(("cpus", "threads", "want"), [
    (0.25, 4, 1), (1, 4, 1), (3.9, 4, 1), (4, 4, 1), (7, 4, 1), (8, 4, 2), (16, 4, 4),
    (16, 1, 16), (2, 8, 1), (64, 8, 8),
])
def test_pool_size_is_whole_encodes_of_the_given_cpus(cpus: float, threads: int, want: int) -> None:
    assert pool_size(cpus, threads) == want


def test_pool_size_refuses_nonsense() -> None:
    for cpus in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="cpus"):
            pool_size(cpus)
    with pytest.raises(ValueError, match="threads"):
        pool_size(8, 0)


def test_rank_cpus_outside_ray_is_the_affinity_mask() -> None:
    """A process pinned to one CPU (taskset, a cpuset) is given one, whatever the host has."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))});"
            "from service.engine.encoder import rank_cpus, pool_size;"
            "print(rank_cpus(), pool_size(rank_cpus()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=300)
    assert out.stdout.split() == ["1.0", "1"]
    assert rank_cpus() == float(len(os.sched_getaffinity(0)))


def test_rank_cpus_in_a_ray_actor_is_its_reservation(ray_cluster: dict) -> None:
    """Ray reserves CPUs without pinning them: the reservation, not the node's cores, counts
    (also in a placement-group bundle, as the service places its ranks)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    class Probe:  # defined here so Ray ships it by value: workers need not import tests/
        def run(self) -> tuple[float, int]:
            enc = Encoder(None)  # what an auto-sized pool makes of the reservation
            try:
                return rank_cpus(), enc.workers
            finally:
                enc.close()

    actor = ray.remote(Probe)
    # Small reservations: the session's cluster has two CPUs, and other tests' apps hold some.
    a = actor.options(num_cpus=0.25).remote()
    assert ray.get(a.run.remote(), timeout=600) == (0.25, 1)  # timeouts: a busy host, not speed
    ray.kill(a)
    pg = placement_group([{"CPU": 0.5}], strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=600)
    try:
        b = actor.options(num_cpus=0.5, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)).remote()
        cpus, workers = ray.get(b.run.remote(), timeout=600)
        assert cpus == 0.5 and workers == pool_size(cpus) == 1
        ray.kill(b)
    finally:
        remove_placement_group(pg)


def test_auto_pool_encodes_the_same_bytes() -> None:
    """``Encoder(None)`` sizes itself and its processes give ``encode_mp4``'s bytes."""
    frames = np.random.default_rng(3).integers(0, 256, (9, 48, 80, 3), dtype=np.uint8)
    enc = Encoder(None)
    got: list[bytes | None] = []
    done = threading.Event()
    try:
        assert enc.workers == pool_size(rank_cpus(), X264_THREADS) >= 1
        enc.submit(frames, 8, lambda data, err: (got.append(data), done.set()))
        assert done.wait(600)
    finally:
        enc.close()
    assert got == [encode_mp4(frames, 8)]


def test_encoders_run_below_the_rank_priority() -> None:
    """The encoder processes (and so their x264 threads) are niced below the rank's process."""
    from service.engine.priority import BACKGROUND_NICE

    enc = Encoder(2)
    try:
        enc.wait_warm()
        pids = enc.pids()
        assert len(pids) == 2
        want = [min(19, os.getpriority(os.PRIO_PROCESS, 0) + BACKGROUND_NICE)] * 2
        end = time.monotonic() + 60  # one process may still be importing: its initializer comes first
        while [os.getpriority(os.PRIO_PROCESS, p) for p in pids] != want and time.monotonic() < end:
            time.sleep(0.1)
        assert [os.getpriority(os.PRIO_PROCESS, p) for p in pids] == want
    finally:
        enc.close()


def test_encoders_flag_default_is_auto_and_a_given_count_wins() -> None:
    from service.api.serve_flags import add_arguments, config_from_args
    from service.jobs import batch

    p = argparse.ArgumentParser()
    add_arguments(p)
    auto = config_from_args(p.parse_args(["/m"]), gpus_per_rank=0.0)
    given = config_from_args(p.parse_args(["/m", "--encoders-per-rank", "3"]), gpus_per_rank=0.0)
    inline = config_from_args(p.parse_args(["/m", "--encoders-per-rank", "0"]), gpus_per_rank=0.0)
    assert auto.encoders_per_rank is None and auto.engine_config().parallel.encoders_per_rank is None
    assert given.engine_config().parallel.encoders_per_rank == 3
    assert inline.engine_config().parallel.encoders_per_rank == 0
    bp = batch.parser()
    assert bp.parse_args(["--prompts", "p", "--out", "o"]).encoders_per_rank is None
    assert bp.parse_args(["--prompts", "p", "--out", "o", "--encoders-per-rank", "2"]).encoders_per_rank == 2
    with pytest.raises(ValueError, match=">= 0"):
        Encoder(-1)
