"""Standby rank processes (engine.standby) under the real dispatcher: real Ray actors in a
placement group, the demo model, a rank SIGKILLed mid-request.

- the rebuilt rank is the standby: the same process id, started before the kill (no new
  interpreter, no imports), and it serves the rerun and the next request with exact bytes;
- a new standby waits after the rebuild; the rank's encoder pool size went with it;
- the group's start breakdown shows the actor start apart from the load, and says when a
  start was a standby's;
- a standby of a one-process group loads while it waits (engine.preload: ``preload_s`` in
  its start's stages)
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from service.config import EngineConfig, OffloadConfig, OffloadMode, ParallelConfig
from service.engine.executor import GroupState
from service.models.request import GenerationRequest
from service.router.build import build_dispatcher
from service.router.dispatcher import Dispatcher
from service.router.policy import DeadlinePolicy
from tests.engine.test_ray_executor import submit, wait_ready
from tests.fakes import RecordingSink

pytestmark = pytest.mark.e2e  # kills a real rank actor and waits for the rebuild


@pytest.fixture
def one_rank(ray_cluster: dict, demo_model: str) -> Iterator[tuple[Dispatcher, RecordingSink]]:
    # encoders_per_rank None: the rank sizes its pool from its CPUs; the standby must get that size
    # standby: on by default on GPU ranks only
    spec = EngineConfig(demo_model, offload=OffloadConfig(OffloadMode.ALLGATHER),
                        parallel=ParallelConfig(dp_size=1, cpus_per_rank=0.5, pg_timeout_s=60,
                                                rank_standby=True))
    sink = RecordingSink()
    d = build_dispatcher(spec, sink, deadlines=DeadlinePolicy(base_s=600))
    d.start()
    try:
        wait_ready(d, timeout=400)
        yield d, sink
    finally:
        d.stop()


def standby_of(d: Dispatcher, gid: str) -> dict:
    """The group's standby once it has imported (its ``started`` answers then)."""
    ex = d.executor
    end = time.monotonic() + 400
    while time.monotonic() < end:
        with ex._lock:
            standbys = list(ex._standbys.get(gid, []))
        if standbys:
            (actor, _), = standbys
            return ray.get(actor.started.remote(), timeout=400)
        time.sleep(0.5)
    raise AssertionError(f"no standby for group {gid}: {ex.status()}")


def test_a_killed_rank_comes_back_as_its_standby(one_rank, resident) -> None:  # noqa: ANN001
    d, sink = one_rank
    (group,) = d.executor._groups.values()
    first = group.started
    assert not first["standby"] and first["pids"] == [ray.get(group.handles[0].ping.remote())]
    assert {"actors_s", "rendezvous_s", "setup_s", "load_s"} <= set(first["stages"])
    assert first["seconds"] == pytest.approx(
        sum(first["stages"][k] for k in ("actors_s", "rendezvous_s", "setup_s")), abs=0.01)
    encoders = first["encoders"]

    standby = standby_of(d, group.info.id)
    assert standby["standby"] and standby["pid"] not in first["pids"] and standby["import_s"] > 0
    # tools that find rank processes by "RankActor" (loadtest/bench_startup.py) never pick a standby
    assert "RankActor" not in Path(f"/proc/{standby['pid']}/cmdline").read_text(errors="replace")
    assert d.status()["standbys"][group.info.id] == [f"dloserve-{group.info.id}-gen0-rank0-standby"]

    req = GenerationRequest(prompt="killed and rerun", seed=3, num_inference_steps=40)
    submit(d, "killed", req)
    sink.wait_progress("killed", timeout=300)
    os.kill(first["pids"][0], signal.SIGKILL)
    out = sink.wait(["killed"], timeout=600)[0]
    assert out.ok and out.mp4 == resident.generate(req), out  # rerun on the rebuilt group, exact
    wait_ready(d, timeout=400)

    again = group.started
    assert group.generation == 1 and group.state is GroupState.READY
    assert again["standby"] and again["pids"] == [standby["pid"]]  # no new interpreter
    assert ray.get(group.handles[0].ping.remote()) == standby["pid"]
    # and loaded while it waited (engine.preload): the take-over only started the rank loop
    assert "preload_s" in again["stages"] and "preload_s" not in first["stages"]
    assert again["encoders"] == encoders
    assert d.status()["workers"] == [f"dloserve-{group.info.id}-gen0-rank0-standby"]

    after = GenerationRequest(prompt="after the standby took over", seed=4)
    submit(d, "after", after)
    assert sink.wait(["after"], timeout=300)[0].mp4 == resident.generate(after)
    nxt = standby_of(d, group.info.id)  # and the next one waits
    assert nxt["pid"] not in (standby["pid"], first["pids"][0])
