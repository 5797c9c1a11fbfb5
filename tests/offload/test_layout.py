import pytest
import torch

from service.offload.layout import ALIGN, ceil_div, overlap, plan_block

TENSORS = [
    ("fc1.weight", torch.bfloat16, (33, 17)),
    ("norm.weight", torch.float32, (17,)),
    ("fc1.bias", torch.bfloat16, (33,)),
    ("table", torch.float32, (2, 17)),
    ("count", torch.int64, (3,)),
]


def test_dtype_regions_and_alignment() -> None:
    lay = plan_block(0, "blocks.0.", TENSORS)
    offsets = [e.offset for e in lay.entries]
    assert all(o % ALIGN == 0 for o in offsets)
    assert offsets == sorted(offsets)
    # one contiguous region per dtype, widest first
    dtypes = [e.dtype for e in lay.entries]
    assert dtypes == [torch.int64, torch.float32, torch.float32, torch.bfloat16, torch.bfloat16]
    # no overlap between tensors
    for a, b in zip(lay.entries, lay.entries[1:], strict=False):
        assert a.offset + a.nbytes <= b.offset
    assert lay.total_bytes % ALIGN == 0
    assert lay.total_bytes >= lay.entries[-1].offset + lay.entries[-1].nbytes
    assert sum(lay.dtype_bytes.values()) == lay.total_bytes
    # bf16: fc1.weight 1122 bytes -> 1280, fc1.bias 66 bytes -> 256
    assert lay.dtype_bytes[torch.bfloat16] == 1280 + 256


def test_views_round_trip() -> None:
    lay = plan_block(0, "b.", TENSORS)
    flat = torch.zeros(lay.total_bytes, dtype=torch.uint8)
    values = {}
    for e in lay.entries:
        v = (torch.arange(e.numel) % 7).to(e.dtype).view(e.shape)
        e.view(flat).copy_(v)
        values[e.name] = v
    for e in lay.entries:
        assert torch.equal(e.view(flat), values[e.name])
        assert e.view(flat).data_ptr() % ALIGN == flat.data_ptr() % ALIGN


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_shards_cover_block_exactly(world: int) -> None:
    lay = plan_block(0, "b.", TENSORS + [("odd", torch.uint8, (7,))])
    shard = lay.shard_bytes(world)
    assert shard == ceil_div(lay.total_bytes, world)
    ranges = [lay.shard_range(r, world) for r in range(world)]
    assert ranges[0][0] == 0
    for (_, hi), (lo, _) in zip(ranges, ranges[1:], strict=False):
        assert hi == lo  # contiguous, equal, no gaps
    assert all(hi - lo == shard for lo, hi in ranges)
    assert lay.padded_bytes(world) == world * shard >= lay.total_bytes
    assert lay.padded_bytes(world) - lay.total_bytes < world


def test_total_not_divisible() -> None:
    lay = plan_block(0, "b.", [("w", torch.uint8, (ALIGN * 3,))])
    assert lay.total_bytes == 3 * ALIGN
    assert lay.shard_bytes(2) == ceil_div(3 * ALIGN, 2)
    assert lay.shard_bytes(5) * 5 >= 3 * ALIGN


def test_overlap_and_errors() -> None:
    assert overlap((0, 10), (5, 20)) == (5, 10)
    assert overlap((0, 5), (5, 20)) is None
    with pytest.raises(ValueError, match="rank 3"):
        plan_block(0, "b.", TENSORS).shard_range(3, 3)
    with pytest.raises(ValueError, match="twice"):
        plan_block(0, "b.", [("a", torch.float32, (1,)), ("a", torch.float32, (1,))])
