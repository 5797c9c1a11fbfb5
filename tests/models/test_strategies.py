"""SHA-256 of one request's MP4 is the same whatever the serving strategy and rank.

Resident, layerwise DP1 (AllGather N=1 and rank-local), DLO AllGather N=2 and N=3 and
rank-local N=2 on real spawned gloo processes: the rank that runs the request changes
too, the others idle-replay. Also in bf16 (mixed bf16/fp32 blocks, Wan's keep-fp32 list).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loadtest.ranks import run_ranks
from service.config import EngineConfig, ModelConfig, OffloadConfig, OffloadMode
from service.models.pipeline import PipelineRunner
from service.models.request import GenerationRequest

REQ = GenerationRequest(prompt="a red fox running through snow", seed=7)  # CFG on: 4 forwards

MODES = {True: OffloadMode.ALLGATHER, False: OffloadMode.RANK_LOCAL}  # --dlo-mode of allgather: bool


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _waves(rank: int, world: int, model: str, out: str) -> None:
    """Three groups from one spawn: N=3 AllGather, N=2 AllGather, N=2 rank-local.

    In each group two waves run: the request on rank 0, then on the group's last rank.
    """
    sub = dist.new_group([0, 1])  # every rank must call new_group, members or not
    plans = [("allgather3", dist.group.WORLD, True), ("allgather2", sub, True), ("ranklocal2", sub, False)]
    results: dict[str, list] = {}
    for name, group, allgather in plans:
        size = dist.get_world_size(group) if rank < 2 or group is dist.group.WORLD else 0
        if size == 0:
            continue
        cfg = EngineConfig(offload=OffloadConfig(MODES[allgather]))
        runner = PipelineRunner.load(model, "cpu", config=cfg, group=group)
        shas = []
        for runs in (0, size - 1):
            if rank == runs:
                shas.append(sha(runner.generate(REQ)))
            else:
                runner.idle(REQ)
        results[name] = [shas, runner.offload_stats()]
        runner.close()
    Path(out, f"{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def reference(resident: PipelineRunner) -> str:
    return sha(resident.generate(REQ))


@pytest.mark.parametrize("allgather", [True, False], ids=["allgather1", "ranklocal1"])
def test_layerwise_dp1_matches_resident(demo_model: str, reference: str, allgather: bool) -> None:
    settings = EngineConfig(offload=OffloadConfig(MODES[allgather]))
    runner = PipelineRunner.load(demo_model, "cpu", config=settings)
    try:
        assert sha(runner.generate(REQ)) == reference
        assert sha(runner.generate(REQ)) == reference  # the ring wrapped: still the same
        stats = runner.offload_stats()
        assert stats is not None and stats["forwards"] == 2 * REQ.forwards() == 8
    finally:
        runner.close()


def test_spawned_ranks_match_resident(demo_model: str, reference: str, tmp_path: Path) -> None:
    run_ranks(_waves, 3, demo_model, str(tmp_path), timeout=None)
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    seen = 0
    for name in ("allgather3", "allgather2", "ranklocal2"):
        size = 3 if name == "allgather3" else 2
        for rank in range(size):
            shas, stats = ranks[rank][name]
            runs = [w for w, r in enumerate((0, size - 1)) if r == rank]
            assert shas == [reference] * len(runs), (name, rank)
            seen += len(shas)
            assert stats["forwards"] == REQ.forwards() * len(runs), (name, rank)
            assert stats["idle_forwards"] == REQ.forwards() * (2 - len(runs)), (name, rank)
            assert stats["world_size"] == size
            if name.startswith("allgather"):
                assert stats["mode"] == "allgather" and stats["gathered_bytes"] > 0
            else:
                assert stats["mode"] == "rank-local" and stats["gathered_bytes"] == 0
    assert "allgather2" not in ranks[2]
    assert seen == 6


def test_bf16_strategies_agree(demo_model: str) -> None:
    """bf16 serving keeps Wan's fp32 modules: blocks hold two dtypes; bytes still equal."""
    digests = {}
    for name, cfg in {
        "resident": EngineConfig(model=ModelConfig(dtype="bfloat16")),
        "allgather": EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER),
                                  model=ModelConfig(dtype="bfloat16")),
        "ranklocal": EngineConfig(offload=OffloadConfig(OffloadMode.RANK_LOCAL),
                                  model=ModelConfig(dtype="bfloat16")),
    }.items():
        runner = PipelineRunner.load(demo_model, "cpu", config=cfg)
        try:
            if runner.handle is not None:
                dtypes = runner.offload_stats()["block_bytes_by_dtype"]
                assert set(dtypes) == {"torch.bfloat16", "torch.float32"}
            assert runner.transformer.blocks[0].scale_shift_table.dtype == torch.float32
            digests[name] = sha(runner.generate(REQ))
        finally:
            runner.close()
    assert len(set(digests.values())) == 1, digests
