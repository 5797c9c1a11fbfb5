"""Sequence parallel (Ulysses, diffusers' own CP code) on two spawned gloo ranks.

One SP group of two runs one request: with DLO (each rank holds half of every block and
an AllGather rebuilds it) the MP4 is byte-equal to the same SP group with a resident
transformer, and to the single-process resident reference. Each rank's blocks really
see half the tokens. A request whose tokens do not split is refused before any compute.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from service.config import EngineConfig, OffloadConfig, OffloadMode
from service.models.adapter import ModelError
from service.models.registry import load_adapter
from service.models.request import GenerationRequest, RequestError

REQ = GenerationRequest(prompt="a red fox running through snow", seed=7)  # 32x32x5: 2x2x2 = 8 tokens


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sp_rank(rank: int, world: int, model: str, out: str) -> None:
    """Both strategies in one spawn; the per-forward lock-step of the service (RankWorker)."""
    from service.engine.rank import RankWorker
    from service.engine.start import control_group
    from service.models.pipeline import PipelineRunner
    from tests.ranks import run_one

    control = control_group(world)
    results = {}
    for name, cfg in (("dlo", EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER))), ("resident",
                                                                                            EngineConfig())):
        runner = PipelineRunner.load(model, "cpu", config=cfg, group=dist.group.WORLD,
                                     sequence_parallel=world)
        seen: list[int] = []
        hooks = [runner.transformer.blocks[0].register_forward_hook(
            lambda _m, _a, out_, seen=seen: seen.append(out_.shape[1]))]
        if name == "dlo" and rank == 1:  # a slow text encoder here: rank 0 reaches its forward first
            hooks.append(runner.adapter._parts["text_encoder"].register_forward_pre_hook(
                lambda *_: time.sleep(0.3)))
        worker = RankWorker(runner, rank, world, control, head_wait_s=0.05, sequence_parallel=True,
                            lead=rank == 0)
        try:
            res = run_one(worker, "r", REQ)
            assert res is not None and res.error is None, res
            results[name] = {
                "sha": sha(res.mp4) if res.mp4 is not None else None,
                "tokens_in_block0": sorted(set(seen)),
                "forwards": worker.forwards, "idle_ticks": worker.idle_ticks,
                "null_ticks": worker.null_ticks,
                "stats": runner.offload_stats(),
            }
            if runner.handle is not None:
                results["block_bytes"] = [lay.total_bytes for lay in runner.handle.layouts]
        finally:
            for h in hooks:
                h.remove()
            worker.close()
            runner.close()
    Path(out, f"{rank}.json").write_text(json.dumps(results))


@pytest.mark.e2e  # two spawned SP ranks
def test_sp2_dlo_equals_sp2_resident_and_one_rank(demo_model: str, resident,
                                                  tmp_path: Path) -> None:  # noqa: ANN001
    from loadtest.ranks import run_ranks

    reference = sha(resident.generate(REQ))
    run_ranks(_sp_rank, 2, demo_model, str(tmp_path), timeout=240)  # a broken lock-step hangs: fail
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    lead, other = ranks
    assert lead["dlo"]["sha"] == lead["resident"]["sha"], "SP2 with DLO != SP2 resident"
    assert lead["dlo"]["sha"] == reference, "SP2 != one resident rank"
    assert other["dlo"]["sha"] is None and other["resident"]["sha"] is None  # the lead reports
    # While rank 1 still encoded text, rank 0 waited at its forward (null ticks) rather than
    # running it beside an idle replay: an all-to-all has no replay.
    assert lead["dlo"]["null_ticks"] > 0
    for r in ranks:
        for name in ("dlo", "resident"):
            assert r[name]["tokens_in_block0"] == [4], (name, r[name])  # 8 tokens, split 2 ways
            assert r[name]["forwards"] == REQ.forwards() and r[name]["idle_ticks"] == 0
        st = r["dlo"]["stats"]
        assert st["world_size"] == 2 and st["forwards"] == REQ.forwards() and st["idle_forwards"] == 0
        assert st["gathered_bytes"] > 0
        # 1/S of the host copy per rank: ceil(block / 2) bytes of every block.
        assert st["host_shard_bytes"] == sum(-(-b // 2) for b in r["block_bytes"])

def test_a_request_that_cannot_split_is_refused_before_compute(demo_model: str) -> None:
    adapter = load_adapter(demo_model, sequence_parallel=2)
    adapter.validate(GenerationRequest(prompt="x", height=48, width=48, num_frames=5))  # 2x3x3 = 18
    with pytest.raises(RequestError) as e:
        adapter.validate(GenerationRequest(prompt="x", height=48, width=48, num_frames=9))  # 3x3x3
    assert e.value.field == "num_frames" and "27 tokens" in e.value.message
    assert "multiple of 2" in e.value.message
    load_adapter(demo_model).validate(GenerationRequest(prompt="x", height=48, width=48, num_frames=9))
    with pytest.raises(ModelError, match="--sequence-parallel-size 3 does not divide the model's 2"):
        load_adapter(demo_model, sequence_parallel=3)  # tiny demo: 2 heads
