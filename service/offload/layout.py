"""Byte layout of one transformer block: where each tensor lives in the flat buffer.

A block's parameters and persistent buffers are packed into one flat byte buffer,
grouped by dtype (one contiguous region per dtype) with every tensor starting at an
``ALIGN``-byte offset. Aligned offsets matter for bitwise equality: a view at an odd
address can make a kernel pick another code path and change the last bits.

One flat buffer per block (rather than one per dtype) means one H2D copy and one
AllGather per block whatever the mix of dtypes, which is where the seed lost time.
The shard math (``shard_bytes``/``shard_range``) is what ``all_gather_into_tensor``
needs: N equal shards, the last one zero padded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

ALIGN = 256


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a block: its name inside the block and its place in the buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This tensor as a typed view into a flat uint8 buffer holding the block."""
        return flat[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclass(frozen=True)
class BlockLayout:
    """Where every tensor of one block sits in its flat byte buffer."""

    index: int
    prefix: str
    entries: tuple[TensorEntry, ...]
    total_bytes: int
    dtype_bytes: dict[torch.dtype, int] = field(hash=False, compare=False)

    def shard_bytes(self, world: int) -> int:
        """Bytes each of ``world`` ranks holds: ceil(total / world)."""
        return ceil_div(self.total_bytes, world)

    def padded_bytes(self, world: int) -> int:
        """Size of the gathered buffer: world equal shards, zero padded at the end."""
        return self.shard_bytes(world) * world

    def shard_range(self, rank: int, world: int) -> tuple[int, int]:
        """Byte range [lo, hi) of the block buffer that ``rank`` owns (hi may pass total)."""
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside world size {world}")
        s = self.shard_bytes(world)
        return rank * s, (rank + 1) * s


def _dtype_order(dtype: torch.dtype) -> tuple[int, str]:
    # Widest dtypes first keeps regions naturally aligned; the name breaks ties.
    return (-dtype.itemsize, str(dtype))


def plan_block(
    index: int, prefix: str, tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]
) -> BlockLayout:
    """Lay out ``(name, dtype, shape)`` triples: dtype regions, aligned offsets.

    Within a dtype the caller's order is kept, so the layout is the same on every rank.
    """
    items = list(tensors)
    names = [n for n, _, _ in items]
    if len(set(names)) != len(names):
        raise ValueError(f"block {prefix!r} lists a tensor twice")
    by_dtype: dict[torch.dtype, list[tuple[str, tuple[int, ...]]]] = {}
    for name, dtype, shape in items:
        by_dtype.setdefault(dtype, []).append((name, tuple(shape)))
    entries: list[TensorEntry] = []
    dtype_bytes: dict[torch.dtype, int] = {}
    offset = 0
    for dtype in sorted(by_dtype, key=_dtype_order):
        start = offset
        for name, shape in by_dtype[dtype]:
            entry = TensorEntry(name, dtype, shape, offset)
            entries.append(entry)
            offset = align_up(offset + entry.nbytes)
        dtype_bytes[dtype] = offset - start
    return BlockLayout(index, prefix, tuple(entries), align_up(offset), dtype_bytes)


def overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """Intersection of two half-open byte ranges, or None."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None
