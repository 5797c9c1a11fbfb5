"""Real gloo groups at N=1..4: offloaded outputs are torch.equal to the resident model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loadtest.ranks import run_ranks
from service.offload import enable_layerwise_offload, load_resident
from service.offload.mode import OffloadMode

from .toy import empty_model, make_checkpoint

FORWARDS = 3  # > 1 so the ring wraps: block 0 of forward k+1 is prefetched by forward k


def _inputs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(2, 9, 16, generator=g) for _ in range(FORWARDS)]


def _rank_main(rank: int, world: int, ckpt: str) -> dict:
    """Each rank runs its own inputs (a DP wave); the last rank of N>1 only idles."""
    out: dict = {}
    for mode in ("allgather", "rank-local"):
        model = empty_model()
        handle = enable_layerwise_offload(
            model, ckpt, device="cpu", group=dist.group.WORLD, mode=mode
        )
        idle = world > 1 and rank == world - 1
        with torch.inference_mode():
            if idle:
                handle.idle_forwards(FORWARDS)
                ys = []
            else:
                ys = [model(x) for x in _inputs(rank)]
        # block weights are placeholders again outside the block's forward
        assert model.blocks[0].fc1.weight.numel() == 0
        if world > 1 and mode == "allgather":  # out of ring order: refused on every rank
            with pytest.raises(RuntimeError, match="expected block 0 to run next but block 2"):
                model.blocks[2](torch.zeros(2, 9, 64))
        out[mode] = {"ys": ys, "stats": handle.stats().as_dict()}
        handle.close()
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("toy") / "model.safetensors"
    make_checkpoint(str(path))
    return str(path)


@pytest.fixture(scope="module")
def reference(ckpt: str) -> dict[int, list[torch.Tensor]]:
    model = load_resident(empty_model(), ckpt)
    with torch.inference_mode():
        return {r: [model(x) for x in _inputs(r)] for r in range(4)}


# 2 (even shards) and 3 (uneven) in make test; 1 and 4 in make e2e (the same code, longer).
@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.e2e), 2, 3,
                                   pytest.param(4, marks=pytest.mark.e2e)])
def test_outputs_equal_resident(world: int, ckpt: str, reference: dict) -> None:
    results = run_ranks(_rank_main, world, ckpt)
    for rank, res in enumerate(results):
        for mode in ("allgather", "rank-local"):
            r = res[mode]
            if world > 1 and rank == world - 1:
                assert r["ys"] == []
                assert r["stats"]["idle_forwards"] == FORWARDS
                continue
            assert len(r["ys"]) == FORWARDS
            for got, want in zip(r["ys"], reference[rank], strict=True):
                assert torch.equal(got, want), f"rank {rank} {mode} N={world} differs from resident"
            assert r["stats"]["forwards"] == FORWARDS
    # every rank issued the same number of gathers (5 blocks per forward, +1 cold start)
    for mode in ("allgather", "rank-local"):
        bytes_ = {res[mode]["stats"]["gathered_bytes"] for res in results}
        assert len(bytes_) == 1
        if world > 1 and mode == "allgather":
            assert bytes_.pop() > 0
            assert all(res[mode]["stats"]["gather_s"] > 0 for res in results)
        else:
            assert all(res[mode]["stats"]["gather_s"] == 0 for res in results)


def _sizes_main(rank: int, world: int, path: str) -> dict:
    model = empty_model()
    h = enable_layerwise_offload(model, path, device="cpu", group=dist.group.WORLD)
    st = h.stats().as_dict()
    st["expected_shard"] = sum(-(-lay.total_bytes // world) for lay in h.layouts)
    st["expected_slots"] = 2 * max(-(-lay.total_bytes // world) * world for lay in h.layouts)
    st["dtype_regions"] = {str(k): v for k, v in h.layouts[0].dtype_bytes.items()}
    h.close()
    return st


def test_shard_and_slot_sizes(ckpt: str) -> None:
    """Host shard = sum of ceil(block/N); device slots = 2 x largest (padded) block."""

    for st in run_ranks(_sizes_main, 3, ckpt):
        assert st["host_shard_bytes"] == st["expected_shard"]
        assert st["device_slot_bytes"] == st["expected_slots"]
        assert set(st["dtype_regions"]) == {"torch.bfloat16", "torch.float32"}
        assert st["host_pinned_bytes"] == 0  # nothing is pinned without CUDA


def test_single_process_without_group(ckpt: str, reference: dict) -> None:
    """group=None is the plain single-GPU layerwise offload (DP1)."""
    model = empty_model()
    handle = enable_layerwise_offload(model, ckpt, device="cpu")
    with torch.inference_mode():
        ys = [model(x) for x in _inputs(0)]
        # one rank, no collective: an out-of-order block just restarts the ring there
        assert model.blocks[2](torch.zeros(2, 9, 64)).shape == (2, 9, 64)
    for got, want in zip(ys, reference[0], strict=True):
        assert torch.equal(got, want)
    handle.close()
    with pytest.raises(RuntimeError, match="closed"):
        handle.idle_forwards(1)


def test_weights_outside_forward_fail_loudly(ckpt: str) -> None:
    model = empty_model()
    handle = enable_layerwise_offload(model, ckpt, device="cpu", mode=OffloadMode.RANK_LOCAL)
    with pytest.raises(RuntimeError):
        torch.nn.functional.linear(torch.zeros(1, 64), model.blocks[2].fc1.weight)
    handle.close()


def test_cast_while_sharding(ckpt: str, tmp_path: Path) -> None:
    """dtype= casts floating tensors while sharding; keep_fp32 names stay fp32."""
    ref = load_resident(empty_model(), ckpt, dtype=torch.float32)
    model = empty_model()
    handle = enable_layerwise_offload(model, ckpt, device="cpu", dtype=torch.float32, keep_fp32=("norm",))
    x = _inputs(0)[0]
    with torch.inference_mode():
        assert torch.equal(model(x), ref(x))
    assert {str(k) for k in handle.layouts[0].dtype_bytes} == {"torch.float32"}
    handle.close()


class _Boom(RuntimeError):
    pass


def test_forward_that_raises_midway_recovers_without_collectives(ckpt: str, reference: dict) -> None:
    """A single rank (or rank-local mode) restarts its ring after a block raised."""
    for use_allgather in (True, False):
        model = empty_model()
        mode = OffloadMode.ALLGATHER if use_allgather else OffloadMode.RANK_LOCAL
        handle = enable_layerwise_offload(model, ckpt, device="cpu", mode=mode)

        def explode(module: torch.nn.Module, args: object) -> None:
            raise _Boom("block 2 failed")

        hook = model.blocks[2].register_forward_pre_hook(explode)
        with torch.inference_mode(), pytest.raises(_Boom):
            model(_inputs(0)[0])
        hook.remove()
        assert model.blocks[1].fc1.weight.numel() == 0  # the block that ran gave its slot back
        with torch.inference_mode():
            ys = [model(x) for x in _inputs(0)]
        for got, want in zip(ys, reference[0], strict=True):
            assert torch.equal(got, want)
        handle.close()


def test_idle_replay_is_free_without_collectives(ckpt: str) -> None:
    model = empty_model()
    handle = enable_layerwise_offload(model, ckpt, device="cpu", mode=OffloadMode.RANK_LOCAL)
    handle.idle_forwards(4)
    assert handle.ring.fills == 0 and handle.stats().idle_forwards == 4
    handle.close()
