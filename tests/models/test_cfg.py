"""CFG in one forward (models.cfg): the same bytes whatever the strategy, half the forwards.

With ``--cfg-batch on`` a CFG request's two rows run in one batch-2 forward per step. Its MP4
is the same resident, DLO AllGather N=2 and rank-local N=2 (real spawned gloo processes; the
rank that runs it changes, the other replays its gathers), and each rank counts one forward
per step, so idle replay stays in step with the running rank.
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
from service.models.cfg import CfgBatched
from service.models.pipeline import PipelineRunner
from service.models.request import GenerationRequest

REQ = GenerationRequest(prompt="a red fox running through snow", negative_prompt="blurry", seed=7,
                        num_inference_steps=3)  # CFG on: 3 forwards batched, 6 unbatched
ON = ModelConfig(cfg_batch="on")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _groups(rank: int, world: int, model: str, out: str) -> None:
    """AllGather N=2, then rank-local N=2: the request on rank 0, then on rank 1."""
    results = {}
    for name, mode in (("allgather2", OffloadMode.ALLGATHER), ("ranklocal2", OffloadMode.RANK_LOCAL)):
        settings = EngineConfig(offload=OffloadConfig(mode), model=ON)
        runner = PipelineRunner.load(model, "cpu", config=settings, group=dist.group.WORLD)
        shas = []
        for runs in (0, 1):
            if rank == runs:
                shas.append(sha(runner.generate(REQ)))
            else:
                runner.idle(REQ)
        results[name] = [shas, runner.offload_stats()]
        runner.close()
    Path(out, f"{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def reference(demo_model: str) -> str:
    runner = PipelineRunner.load(demo_model, "cpu", config=EngineConfig(model=ON))
    try:
        assert runner.cfg_batch and runner.adapter.forwards(REQ) == REQ.num_inference_steps
        return sha(runner.generate(REQ))
    finally:
        runner.close()


def test_batched_bytes_equal_across_strategies(demo_model: str, reference: str, tmp_path: Path) -> None:
    run_ranks(_groups, 2, demo_model, str(tmp_path), timeout=None)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        for name in ("allgather2", "ranklocal2"):
            shas, stats = got[name]
            assert shas == [reference], (name, rank)
            assert stats["forwards"] == REQ.num_inference_steps, (name, rank)  # one per step
            assert stats["idle_forwards"] == REQ.num_inference_steps, (name, rank)


def test_rank_local_dp1_batched_equals_resident(demo_model: str, reference: str) -> None:
    config = EngineConfig(offload=OffloadConfig(OffloadMode.RANK_LOCAL), model=ON)
    runner = PipelineRunner.load(demo_model, "cpu", config=config)
    try:
        assert sha(runner.generate(REQ)) == reference
        assert runner.describe()["cfg_batch"] is True
    finally:
        runner.close()


def test_which_requests_are_batched(demo_model: str) -> None:
    """A function of the request and the server's settings: CFG on and no step cache."""
    runner = PipelineRunner.load(demo_model, "cpu", config=EngineConfig(model=ON))
    try:
        a = runner.adapter
        assert a.cfg_batched(REQ)
        assert not a.cfg_batched(GenerationRequest(prompt="x", guidance_scale=1.0))  # no CFG
        cached = GenerationRequest(prompt="x", num_inference_steps=3, cache={"method": "first_block"})
        assert not a.cfg_batched(cached) and a.forwards(cached) == 6
    finally:
        runner.close()
    off = PipelineRunner.load(demo_model, "cpu", config=None)  # auto on CPU: off
    try:
        assert not off.cfg_batch and off.adapter.forwards(REQ) == 6
    finally:
        off.close()


class _Echo(torch.nn.Module):
    """Returns its text context's first feature per row: which rows went where."""

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                return_dict: bool = False) -> tuple[torch.Tensor]:
        return (hidden_states + encoder_hidden_states[:, :1, :1],)

    def cache_context(self, name: str, **kw: object):  # noqa: ANN201 - diffusers' CacheMixin's shape
        from contextlib import nullcontext

        return nullcontext()


def test_the_batcher_pairs_rows_and_refuses_stray_calls() -> None:
    cond, neg, x = torch.full((1, 2, 1), 1.0), torch.full((1, 2, 1), 10.0), torch.zeros(1, 3, 1)
    b = CfgBatched(_Echo(), neg)
    with b.cache_context("cond"):
        (c,) = b(hidden_states=x, encoder_hidden_states=cond, return_dict=False)
    with b.cache_context("uncond"):
        (u,) = b(hidden_states=x, encoder_hidden_states=neg, return_dict=False)
    assert torch.equal(c, x + 1) and torch.equal(u, x + 10) and b.forwards == 1
    with pytest.raises(RuntimeError, match="no conditional one before it"), b.cache_context("uncond"):
        b(hidden_states=x, encoder_hidden_states=neg)
    with pytest.raises(RuntimeError, match="outside the cond/uncond"):
        b(hidden_states=x, encoder_hidden_states=cond)
