"""Standby rank processes (engine.standby) under the real dispatcher: real Ray actors in a
placement group, the demo model, a rank SIGKILLed mid-request.

- the rebuilt rank is the standby: the same process id, started before the kill (no new
  interpreter, no imports), and it serves the rerun and the next request with exact bytes;
- a new standby waits after the rebuild; the rank's encoder pool size went with it;
- the group's start breakdown shows the actor start (process and imports) apart from the
  load on a first start, and says when a start was a standby's;
- a standby, and a pre-started process, of a one-process group loads while it waits
  (engine.preload: ``preload_s`` in its start's stages).
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
    assert {"actors_s", "actors.import_s", "rendezvous_s", "setup_s", "load_s"} <= set(first["stages"])
    assert first["seconds"] == pytest.approx(
        sum(first["stages"][k] for k in ("actors_s", "rendezvous_s", "setup_s")), abs=0.01)
    encoders = first["encoders"]

    standby = standby_of(d, group.info.id)
    assert standby["standby"] and standby["pid"] not in first["pids"]
    # tools that find rank processes by "RankActor" (loadtest/bench_startup.py) never pick a standby
    assert "RankActor" not in Path(f"/proc/{standby['pid']}/cmdline").read_text(errors="replace")
    assert d.status()["standbys"][group.info.id] == [f"dloserve-{group.info.id}-gen0-rank0-standby"]

    req = GenerationRequest(prompt="killed and rerun", seed=3, num_inference_steps=40)
    submit(d, "killed", req)
    sink.wait_progress("killed", timeout=300)
    t_kill = time.time()
    assert standby["created"] < t_kill
    os.kill(first["pids"][0], signal.SIGKILL)
    out = sink.wait(["killed"], timeout=600)[0]
    assert out.ok and out.mp4 == resident.generate(req), out  # rerun on the rebuilt group, exact
    wait_ready(d, timeout=400)

    again = group.started
    assert group.generation == 1 and group.state is GroupState.READY
    assert again["standby"] and again["pids"] == [standby["pid"]]  # no new interpreter
    assert ray.get(group.handles[0].ping.remote()) == standby["pid"]
    assert "actors.import_s" not in again["stages"]  # it imported before the kill
    # and loaded while it waited (engine.preload): the take-over only started the rank loop
    assert "preload_s" in again["stages"] and "preload_s" not in first["stages"]
    assert again["encoders"] == encoders
    assert d.status()["workers"] == [f"dloserve-{group.info.id}-gen0-rank0-standby"]

    after = GenerationRequest(prompt="after the standby took over", seed=4)
    submit(d, "after", after)
    assert sink.wait(["after"], timeout=300)[0].mp4 == resident.generate(after)
    nxt = standby_of(d, group.info.id)  # and the next one waits
    assert nxt["pid"] not in (standby["pid"], first["pids"][0])


def test_the_first_groups_adopt_the_pre_started_ranks(ray_cluster: dict, demo_model: str, resident) -> None:  # noqa: ANN001
    """``dloserve serve`` starts the rank processes before Serve (engine.standby.prestart); the
    executor adopts them for its first groups: the same process ids (no new interpreter), their
    import time reported apart. One that died before adoption is replaced by a new process."""
    import uuid

    from service.engine.place import NAMESPACE, RankPlace
    from service.engine.standby import prestart

    spec = EngineConfig(demo_model, offload=OffloadConfig(OffloadMode.RANK_LOCAL),
                        parallel=ParallelConfig(dp_size=2, cpus_per_rank=0.5, pg_timeout_s=60,
                                                rank_standby=False, encoders_per_rank=0))
    held = prestart(spec, uuid.uuid4().hex[:8], NAMESPACE)
    names, actors = list(held), list(held.values())
    pids = [s["pid"] for s in ray.get([a.started.remote() for a in actors], timeout=400)]
    ray.kill(actors[1])  # gone before the executor looks for it
    sink = RecordingSink()
    d = build_dispatcher(spec, sink, deadlines=DeadlinePolicy(base_s=600), prestarted=names)
    d.start()
    try:
        wait_ready(d, timeout=400)
        first, second = sorted(d.executor._groups.values(), key=lambda g: g.info.first_rank)
        assert first.started["prestarted"] and first.started["pids"] == [pids[0]]
        assert ray.get(first.handles[0].ping.remote()) == pids[0]
        stages = first.started["stages"]
        assert "prestart.import_s" in stages and "actors.import_s" not in stages
        assert "preload_s" in stages  # rank-local ranks: it loaded while it waited (engine.preload)
        assert "preload_s" not in second.started["stages"]
        assert not second.started["prestarted"] and second.started["pids"] != [pids[1]]
        assert "actors.import_s" in second.started["stages"]  # a new process: its imports were this start's
        assert d.executor.startup["prestart_imported_at"] > 0
        assert d.executor._prestarted == {}  # each name used once
        # a process outliving a replica that crashed is refused by the next one (which stops it)
        with pytest.raises(ray.exceptions.RayTaskError, match="already adopted as rank 0"):
            ray.get(actors[0].adopt.remote(spec, RankPlace("again", 0, 1), None), timeout=60)
        req = GenerationRequest(prompt="on an adopted rank", seed=5)
        for i in range(2):
            submit(d, f"r{i}", req)
        for out in sink.wait(["r0", "r1"], timeout=300):
            assert out.ok and out.mp4 == resident.generate(req), out
    finally:
        d.stop()
