"""Resident blocks: any count 0..L gives outputs torch.equal to resident, under collectives too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loadtest.ranks import run_ranks
from service.offload import Placement, enable_layerwise_offload, load_resident
from service.offload.mode import OffloadMode

from .toy import empty_model, make_checkpoint

DEPTH = 5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("toy") / "model.safetensors"
    make_checkpoint(str(path), depth=DEPTH)
    return str(path)


def _inputs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7 + rank)
    return [torch.randn(2, 9, 16, generator=g) for _ in range(2)]


def _reference(ckpt: str, rank: int) -> list[torch.Tensor]:
    model = load_resident(empty_model(depth=DEPTH), ckpt)
    with torch.inference_mode():
        return [model(x) for x in _inputs(rank)]


@pytest.mark.parametrize("use_allgather", [True, False])
def test_every_resident_count_is_bitwise_equal(ckpt: str, use_allgather: bool) -> None:
    want = _reference(ckpt, 0)
    for k in range(DEPTH + 1):
        model = empty_model(depth=DEPTH)
        h = enable_layerwise_offload(model, ckpt, device="cpu",
                                     mode=OffloadMode.ALLGATHER if use_allgather else OffloadMode.RANK_LOCAL,
                                     placement=Placement(resident_blocks=k))
        with torch.inference_mode():
            got = [model(x) for x in _inputs(0)]
        st = h.stats()
        assert st.resident_blocks == k and st.forwards == 2
        sizes = [lay.total_bytes for lay in h.layouts]
        resident = [i for i in range(DEPTH) if model.blocks[i].fc1.weight.numel()]  # placeholders are empty
        assert len(resident) == k
        assert st.device_resident_block_bytes == sum(sizes[i] for i in resident)
        streamed = [sizes[i] for i in range(DEPTH) if i not in resident]
        assert st.device_slot_bytes == (2 * max(streamed) if streamed else 0)
        if use_allgather:  # resident blocks are not in the host shards
            assert st.host_shard_bytes == sum(streamed)
        h.close()
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), f"resident_blocks={k} differs from resident"


def _ranks_main(rank: int, world: int, ckpt: str) -> dict:
    out = {}
    for k in (0, 2, DEPTH):
        model = empty_model(depth=DEPTH)
        h = enable_layerwise_offload(model, ckpt, device="cpu", group=dist.group.WORLD,
                                     placement=Placement(resident_blocks=k))
        with torch.inference_mode():
            ys = [model(x) for x in _inputs(rank)]
            h.idle_forwards(1)  # the other rank's idle replay must match ours
        out[k] = {"ys": ys, "stats": h.stats().as_dict()}
        h.close()
    return out


def test_resident_blocks_under_allgather(ckpt: str) -> None:
    results = run_ranks(_ranks_main, 2, ckpt)
    for rank, res in enumerate(results):
        want = _reference(ckpt, rank)
        for k, r in res.items():
            for g, w in zip(r["ys"], want, strict=True):
                assert torch.equal(g, w), f"rank {rank} resident_blocks={k}"
            st = r["stats"]
            assert st["resident_blocks"] == k
            assert (st["gathered_bytes"] > 0) == (k < DEPTH)  # all resident: no gathers at all


def test_budget_is_respected(ckpt: str, tmp_path: Path) -> None:
    model = empty_model(depth=DEPTH)
    h0 = enable_layerwise_offload(model, ckpt, device="cpu")
    block = h0.layouts[0].total_bytes
    base = h0.stats().device_resident_bytes  # non-block tensors
    h0.close()
    reserve = 4096
    for k_fit in (0, 1, 2, DEPTH):  # (3 resident + 2 slots = 5 blocks: all resident then)
        slots = 0 if k_fit == DEPTH else 2 * block
        budget = base + reserve + slots + k_fit * block + block // 2  # half a block to spare
        model = empty_model(depth=DEPTH)
        h = enable_layerwise_offload(model, ckpt, device="cpu", placement=Placement(
            device_memory_budget=budget, activation_bytes=reserve))
        st = h.stats()
        assert st.resident_blocks == k_fit
        assert st.device_slot_bytes + st.device_resident_bytes + reserve <= budget
        h.close()
    with pytest.raises(ValueError, match="device_memory_budget"):
        enable_layerwise_offload(empty_model(depth=DEPTH), ckpt, device="cpu",
                                 placement=Placement(device_memory_budget=base + block))


def test_pagecache_required_without_cuda_is_refused(ckpt: str) -> None:
    with pytest.raises(RuntimeError, match="page-cache DMA was required but the device is not CUDA"):
        enable_layerwise_offload(empty_model(depth=DEPTH), ckpt, device="cpu", mode=OffloadMode.RANK_LOCAL,
                                 placement=Placement(pagecache=True))
    model = empty_model(depth=DEPTH)
    h = enable_layerwise_offload(model, ckpt, device="cpu",
                                 mode=OffloadMode.RANK_LOCAL)  # None: packs, says why
    assert h.stats().rank_local_source == "pack" and "CPU device" in h.stats().source_reason
    h.close()


def test_blocks_filled_behind_the_load_are_waited_for(ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Placement(fill_behind=True)``: the handle returns while the resident blocks still copy
    (a slow file, here); a forward then waits for each block's bytes, so its outputs are the
    resident model's; ``wait_resident`` ends the wait hooks; a handle closed mid-fill stops."""
    import time

    from service.offload import fill as fill_mod
    from service.offload import layerwise

    class SlowFill(fill_mod.ResidentFill):
        def __init__(self, blocks, view, dev, workers=None):  # noqa: ANN001, ANN204 - the same call
            def slow(key: str) -> torch.Tensor:
                time.sleep(0.05)
                return view(key)

            super().__init__(blocks, slow, dev, workers=1)

    monkeypatch.setattr(layerwise, "ResidentFill", SlowFill)
    want = _reference(ckpt, 0)
    model = empty_model(depth=DEPTH)
    h = enable_layerwise_offload(model, ckpt, device="cpu", mode=OffloadMode.RANK_LOCAL,
                                 placement=Placement(resident_blocks=DEPTH, fill_behind=True))
    assert h._fill is not None and len(h._fill_hooks) == DEPTH  # still copying
    with torch.inference_mode():
        got = [model(x) for x in _inputs(0)]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    h.wait_resident()
    assert h._fill is None and h._fill_hooks == []
    h.close()
    early = enable_layerwise_offload(empty_model(depth=DEPTH), ckpt, device="cpu",
                                     mode=OffloadMode.RANK_LOCAL,
                                     placement=Placement(resident_blocks=DEPTH, fill_behind=True))
    early.close()  # mid-fill: the copies not begun are dropped, the rest end first
    assert early._fill is None
