"""A CFG-batched request and a plain one in one AllGather group (two real gloo ranks).

With ``--cfg-batch on`` rank 0's CFG request makes one forward per step; rank 1's request,
CFG with a step cache (run unbatched, two forwards per step), makes twice as many. The tick
loop counts each rank's own forwards (``adapter.forwards``), so both ranks make the same
ticks (the same gathers) and each MP4 equals its resident reference under the same settings.
"""

from __future__ import annotations

import threading

import torch.distributed as dist

from loadtest.ranks import run_ranks
from service.config import EngineConfig, ModelConfig, OffloadConfig, OffloadMode
from service.engine.encoder import Encoder
from service.engine.events import EventKind
from service.engine.rank import RankWorker
from service.engine.start import control_group
from service.models.pipeline import PipelineRunner
from service.models.request import GenerationRequest
from tests.ranks import collect

BATCHED = GenerationRequest(prompt="batched", seed=1, num_inference_steps=4)  # 4 forwards
PLAIN = GenerationRequest(prompt="plain", seed=2, num_inference_steps=3,
                          cache={"method": "first_block", "threshold": 0.05})  # 6 forwards, unbatched


def _scenario(rank: int, world: int, model: str) -> dict:
    runner = PipelineRunner.load(model, "cpu",
                                 config=EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER),
                                                     model=ModelConfig(cfg_batch="on")),
                                 group=dist.group.WORLD)
    worker = RankWorker(runner, rank, world, control_group(world), Encoder(1), head_wait_s=5.0)
    try:
        job, req = ("batched", BATCHED) if rank == 0 else ("plain", PLAIN)
        worker.assign(job, req)
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(collect(worker, {job})))
        t.start()
        worker.serve()
        t.join(timeout=120)
        fin = out[job][EventKind.FINISHED]
        return {"log": list(worker.tick_log), "error": fin.error, "mp4": fin.mp4,
                "stats": runner.offload_stats()}
    finally:
        worker.close()
        runner.close()


def test_batched_and_plain_share_a_group(demo_model: str) -> None:
    r0, r1 = run_ranks(_scenario, 2, demo_model, timeout=480)
    assert r0["error"] is None and r1["error"] is None
    assert len(r0["log"]) == len(r1["log"])  # the same ticks: the same gathers, in order
    assert r0["log"].count("batched") == BATCHED.num_inference_steps
    assert r1["log"].count("plain") == PLAIN.forwards() == 6
    resident = PipelineRunner.load(demo_model, "cpu", config=EngineConfig(model=ModelConfig(cfg_batch="on")))
    try:
        assert r0["mp4"] == resident.generate(BATCHED)
        assert r1["mp4"] == resident.generate(PLAIN)
    finally:
        resident.close()
