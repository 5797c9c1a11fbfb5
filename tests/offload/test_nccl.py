"""AllGather over NCCL across real GPUs (one process per GPU). Runs where >= 2 GPUs exist."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loadtest.ranks import run_ranks
from service.offload import enable_layerwise_offload, load_resident

from .toy import empty_model, make_checkpoint

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
SIZE = (256, 1024, 7)


def _inputs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(2, 333, 16, generator=g) for _ in range(3)]


def _main(rank: int, world: int, ckpt: str) -> dict:
    dev = torch.device("cuda", rank)
    ref = load_resident(empty_model(*SIZE), ckpt, device=dev)
    out = {}
    for mode in ("allgather", "rank-local"):
        model = empty_model(*SIZE)
        h = enable_layerwise_offload(model, ckpt, device=dev, group=dist.group.WORLD,
                                     mode=mode)
        with torch.inference_mode():
            # wave 1: every rank its own request; wave 2: only rank 0, the others idle
            equal = [torch.equal(model(x.to(dev)), ref(x.to(dev))) for x in _inputs(rank)]
            if rank == 0:
                equal += [torch.equal(model(x.to(dev)), ref(x.to(dev))) for x in _inputs(9)]
            else:
                h.idle_forwards(3)
        torch.cuda.synchronize()
        out[mode] = {"equal": equal, "stats": h.stats().as_dict()}
        h.close()
    return out


def test_nccl_two_gpus_equal_resident(tmp_path: Path) -> None:
    ckpt = tmp_path / "m.safetensors"
    make_checkpoint(str(ckpt), *SIZE)
    for rank, res in enumerate(run_ranks(_main, 2, str(ckpt), backend="nccl")):
        for mode, r in res.items():
            assert all(r["equal"]), f"rank {rank} {mode}: {r['equal']}"
            assert len(r["equal"]) == (6 if rank == 0 else 3)
        st = res["allgather"]["stats"]
        assert st["gathered_bytes"] > 0 and st["host_pinned_bytes"] == st["host_shard_bytes"]
