"""The layerwise offload runtime: host copies, two device slots, the prefetch ring.

State is kept apart from mechanism (as in FSDP2): ``HostBlocks`` owns what sits in host
memory, ``comm.Device`` owns streams/events/threads, and ``Ring`` decides which block
goes into which slot next. Hooks on each block only ask the ring for their weights.

The ring: gathers are issued in the fixed order 0, 1, ..., L-1, 0, 1, ... on every rank,
one block ahead of compute. Slots alternate per issued fill, not per block index, so an
odd block count does not make the wrap-around prefetch of block 0 land in the slot that
block L-1 is still computing in. The same order on every rank is what keeps collectives
matched, including on a rank that only replays gathers (``idle_forwards``).

Segments (two experts): the blocks may be split into runs that each make one module's
forward (a Wan2.2 pipeline's ``transformer`` and ``transformer_2``). Within a segment fills
go in block order; after a segment's last block the ring fills the first block of the
segment it was told to ``expect`` next, so the switch to the other expert is prefetched
like any other block. ``begin`` drops a prefetch that guessed wrong and fills the right
block; every rank of a group must be told the same, so their fills stay matched.

A forward may stop early (a step cache skipped the rest of it): ``Ring.stop`` right after
its segment's first block, or before any, keeps what the slots hold for the next forward
(the prefetched next block, and the first block still in its slot), so the fill sequence
stays the same on every rank and nothing is filled that no forward uses. If the next
forward is another segment's, ``begin`` drops what was kept, as it drops any prefetch of
the wrong segment (one redirect, the same on every rank).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .checkpoint import Checkpoint
from .comm import Device, Group, Pending
from .layout import BlockLayout, overlap
from .mode import OffloadMode

log = logging.getLogger("dloserve.offload")


@dataclass
class BlockSource:
    """Where a block's bytes come from on the host."""

    layout: BlockLayout
    keys: dict[str, str]  # entry name -> checkpoint key
    shard: torch.Tensor | None = None  # AllGather mode: this rank's bytes


class HostBlocks:
    """Host side of every block: 1/N shards (AllGather) or the shared mmap (rank-local)."""

    def __init__(
        self,
        ckpt: Checkpoint,
        layouts: list[BlockLayout],
        keys: list[dict[str, str]],
        group: Group,
        device: Device,
        mode: OffloadMode,
        progress: Callable[[int, int], None] | None = None,
        pagecache: bool | None = None,
    ) -> None:
        self.ckpt = ckpt
        self.group = group
        self.device = device
        self.gathers = mode.gathers  # 1/N shards rebuilt by AllGathers (else the whole block, rank-local)
        self.blocks = [BlockSource(lay, k) for lay, k in zip(layouts, keys, strict=True)]
        self.pinned: list[torch.Tensor] = []
        self.registered: list[torch.Tensor] = []  # page-cache mappings registered for DMA
        self.staging: list[torch.Tensor] = []
        self.source = "shards" if self.gathers else "pack"
        self.source_reason = ""
        if not self.blocks:
            return
        if self.gathers:
            self._shard_all(progress)
            return
        if not device.is_cuda:
            if pagecache:
                raise RuntimeError("page-cache DMA was required but the device is not CUDA")
            self.source_reason = "CPU device: the pack thread writes the slot directly"
            return
        if pagecache is not False:
            why = self._register_pagecache()
            if why is None:
                self.source = "pagecache"
                self.source_reason = "the copy engine reads the registered read-only page cache"
                return
            if pagecache:
                raise RuntimeError(f"page-cache DMA was required but is not possible: {why}")
            self.source_reason = f"pack thread: page-cache DMA not possible ({why})"
            log.warning("rank-local offload falls back to the pack thread: %s", why)
        else:
            self.source_reason = "pack thread (page-cache DMA switched off)"
        # Pack: two pinned staging buffers, sized by the largest block.
        size = max(b.layout.total_bytes for b in self.blocks)
        for _ in range(2):  # one at a time, so close() unpins whatever got pinned
            self.staging.append(device.pin(torch.empty(size, dtype=torch.uint8)))
            self.pinned.append(self.staging[-1])

    def dma_problem(self) -> str | None:
        """Why the blocks' bytes cannot be DMA'd as the files store them, or None."""
        for b in self.blocks:
            for e in b.layout.entries:
                rec = self.ckpt.records[b.keys[e.name]]
                if rec.source is not None:
                    return (f"{rec.key} is {rec.dtype} computed at load from {rec.source.dtype} "
                            "(quantize the checkpoint once with `dloserve quantize` to DMA it)")
                if rec.dtype != e.dtype:
                    return (f"{rec.key} is {rec.dtype} in the file and served as {e.dtype} "
                            "(a cast needs the pack)")
                if rec.begin % e.dtype.itemsize:
                    return f"{rec.key} is at an odd offset in {rec.file.name}"
        return None

    def _register_pagecache(self) -> str | None:
        """Register the checkpoint files' read-only mappings for DMA; None, or why not."""
        why = self.dma_problem()
        if why is not None:
            return why
        files = self.ckpt.mapped_bytes({k for b in self.blocks for k in b.keys.values()})
        for t in files:
            err = self.device.register_readonly(t)
            if err is not None:
                for done in self.registered:
                    self.device.unpin(done)
                self.registered.clear()
                return err
            self.registered.append(t)
        return None

    @property
    def collective(self) -> bool:
        """Whether fills are collectives that every rank must make in the same order."""
        return self.gathers and self.group.world > 1 and bool(self.blocks)

    @property
    def pinned_bytes(self) -> int:
        return sum(t.numel() for t in self.pinned) if self.device.is_cuda else 0

    @property
    def registered_bytes(self) -> int:
        """Page-cache bytes registered for DMA (shared with every process mapping the files)."""
        return sum(t.numel() for t in self.registered)

    @property
    def shard_bytes(self) -> int:
        return sum(b.shard.numel() for b in self.blocks if b.shard is not None)

    def _shard_all(self, progress: Callable[[int, int], None] | None) -> None:
        world, rank = self.group.world, self.group.rank
        total = sum(b.layout.shard_bytes(world) for b in self.blocks)
        # One host allocation for every shard, pinned once at its exact size.
        arena = torch.zeros(total, dtype=torch.uint8)
        offset = 0
        for pos, b in enumerate(self.blocks):
            n = b.layout.shard_bytes(world)
            b.shard = arena.narrow(0, offset, n)
            offset += n
            self._copy_range(b, b.layout.shard_range(rank, world), b.shard)
            # This rank has its bytes: drop the mapping of the block's pages (PSS falls).
            self.ckpt.release(b.keys.values())
            if progress is not None:
                progress(pos + 1, len(self.blocks))
        self.pinned.append(self.device.pin(arena))

    def _copy_range(self, b: BlockSource, rng: tuple[int, int], dst: torch.Tensor) -> None:
        """Write bytes [lo, hi) of the block's flat buffer into ``dst``, casting as laid out."""
        for e in b.layout.entries:
            ov = overlap(rng, (e.offset, e.offset + e.nbytes))
            if ov is None:
                continue
            size = e.dtype.itemsize
            first, last = (ov[0] - e.offset) // size, -(-(ov[1] - e.offset) // size)
            part = self.ckpt.flat(b.keys[e.name], first, last).to(e.dtype).view(torch.uint8)
            skip = ov[0] - e.offset - first * size
            dst[ov[0] - rng[0] : ov[1] - rng[0]].copy_(part[skip : skip + ov[1] - ov[0]])

    def pack(self, index: int, dst: torch.Tensor) -> None:
        """Rank-local: copy block ``index`` from the mmap views into ``dst`` (whole block)."""
        b = self.blocks[index]
        for e in b.layout.entries:
            e.view(dst).copy_(self.ckpt.view(b.keys[e.name]))

    def dma_pairs(self, index: int, out: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Page-cache mode: (slot bytes, registered file bytes) of each tensor of the block."""
        b = self.blocks[index]
        return [(out[e.offset : e.offset + e.nbytes], self.ckpt.raw(b.keys[e.name]))
                for e in b.layout.entries]

    def close(self) -> None:
        for t in self.pinned + self.registered:
            self.device.unpin(t)
        self.pinned.clear()
        self.registered.clear()
        for b in self.blocks:
            b.shard = None


class Ring:
    """Issues slot fills in ring order, one block ahead of compute."""

    def __init__(
        self,
        host: HostBlocks,
        device: Device,
        slots: list[torch.Tensor],
        on_fill: Callable[[BlockLayout], None] = lambda layout: None,
        segments: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        self.host = host
        self.on_fill = on_fill
        self.device = device
        self.slots = slots
        self.n = len(host.blocks)
        # The next block the ring will fill; None: the successor of the last one filled, found
        # when it is issued (so an ``expect`` made since the last fill still counts).
        self.next_block: int | None = 0
        self._last = 0
        self.next_slot = 0
        self.pending: Pending | None = None  # the one fill in flight or done, not yet used
        self.current: Pending | None = None  # the block compute is using now
        self.last: Pending | None = None  # the block compute used last (its slot may still hold it)
        self.reuse: Pending | None = None  # a segment's first block, kept by a forward that stopped
        self.fills = 0
        # [lo, hi) ring positions of each segment (one module's forward); one segment: all.
        self.segments = list(segments) if segments else [(0, self.n)]
        self._segment_of = [s for s, (lo, hi) in enumerate(self.segments) for _ in range(lo, hi)]
        if len(self._segment_of) != self.n:
            raise ValueError(f"segments {self.segments} do not tile the {self.n} streamed blocks")
        # The segment whose first block follows the last block of a segment; None: the same
        # segment again (a single segment is the plain ring 0..L-1, 0..).
        self.upcoming: int | None = None
        self.redirects = 0  # prefetches dropped because another segment came next

    def _issue(self) -> Pending:
        block = self._successor(self._last) if self.next_block is None else self.next_block
        slot = self.next_slot
        b = self.host.blocks[block]
        world = self.host.group.world
        if self.host.gathers:
            assert b.shard is not None
            out = self.slots[slot].narrow(0, 0, b.layout.padded_bytes(world))
            p = self.device.gather(block, slot, out, b.shard)
        elif self.host.source == "pagecache":
            out = self.slots[slot].narrow(0, 0, b.layout.total_bytes)
            p = self.device.copy_in(block, slot, self.host.dma_pairs(block, out))
        else:
            out = self.slots[slot].narrow(0, 0, b.layout.total_bytes)
            staging = self.host.staging[slot] if self.device.is_cuda else None
            staged = staging.narrow(0, 0, b.layout.total_bytes) if staging is not None else None
            p = self.device.stage(block, slot, out, staged, lambda dst, i=block: self.host.pack(i, dst))
        self._last, self.next_block = block, None
        self.next_slot = 1 - slot
        self.fills += 1
        self.on_fill(b.layout)
        return p

    def _successor(self, block: int) -> int:
        """The fill after ``block``: the next block of its segment, or the expected segment's first."""
        seg = self._segment_of[block]
        if block + 1 < self.segments[seg][1]:
            return block + 1
        return self.segments[seg if self.upcoming is None else self.upcoming][0]

    def expect(self, segment: int) -> None:
        """Prefetch ``segment``'s first block after the current segment's last (a segment with
        nothing streamed is skipped: the fill goes to the next one that has blocks)."""
        k = len(self.segments)
        for s in (segment + j for j in range(k)):
            lo, hi = self.segments[s % k]
            if lo < hi:
                self.upcoming = s % k
                return

    def begin(self, segment: int) -> bool:
        """A forward of ``segment`` starts: if the prefetched fill is another block, wait it out
        and fill this segment's first block instead. True when a prefetch was dropped."""
        lo, hi = self.segments[segment]
        if lo == hi:
            return False
        if self.reuse is not None:
            if self.reuse.block == lo:  # a stopped forward of this segment kept lo in its slot
                return False
            self.reuse = None  # another segment: its slot is the next one filled
        if self.pending is None:
            self.next_block = lo  # cold start: acquire() issues it
            return False
        if self.pending.block == lo:
            return False
        self.pending.wait()  # every rank made the same fill: drop it on every rank
        self.redirects += 1
        self.next_block = lo
        self.pending = self._issue()
        return True

    def acquire(self, block: int) -> tuple[Pending, float]:
        """Wait for ``block``'s weights, then start filling the next block in the ring."""
        if self.reuse is not None:
            r, self.reuse = self.reuse, None
            if r.block == block:  # still in its slot; the block after it is pending already
                self.current = self.last = r
                return r, 0.0
        if self.pending is None:
            # Cold start (first forward): nothing prefetched yet.
            self.pending = self._issue()
        p = self.pending
        if p.block != block:
            if self.host.collective:
                raise RuntimeError(
                    f"layerwise offload expected block {p.block} to run next but block {block} was "
                    "called: blocks must run once each, in order, in every forward (the ranks' "
                    "gathers are now out of step: close the handle and rebuild the group)"
                )
            # No collective involved: drop the prefetch and restart the ring at ``block``
            # (after a forward that raised midway, say).
            p.wait()
            self.next_block = block
            self.pending = p = self._issue()
        t0 = time.perf_counter()
        p.wait()
        waited = time.perf_counter() - t0  # host time blocked (CPU work, or a rank-local pack)
        self.current = self.last = p
        self.pending = self._issue()
        return p, waited

    def stop(self, lo: int = 0) -> bool:
        """The forward of the segment starting at ``lo`` ends here, before the pending block;
        True if ``lo`` stays in its slot for reuse.

        Only before the forward's first block (``lo`` is pending: it waits for the next
        forward) or right after it (``lo + 1`` is pending and ``lo`` is still in its slot:
        the next forward of this segment takes both without a fill). Elsewhere the slots
        hold blocks the next forward cannot start with, so it is refused.
        """
        p = self.pending
        if p is None or p.block == lo:
            return False
        if (p.block == lo + 1 and self._segment_of[lo] == self._segment_of[p.block] and self.current is None
                and self.last is not None and self.last.block == lo):
            self.reuse = Pending(lo, self.last.slot, None)
            return True
        raise RuntimeError(f"a forward can stop before its first or second block, not before block {p.block}")

    def release(self) -> None:
        if self.current is not None:
            self.device.release(self.current.slot)
            self.current = None

    def reset(self) -> None:
        """Drain, then restart at block 0 in slot 0 (a ring whose slots are freed between uses)."""
        self.drain()
        self.next_block = self.next_slot = 0

    def drain(self) -> None:
        """Wait for the fill in flight (all ranks have issued the same one)."""
        if self.pending is not None:
            self.pending.wait()
        self.pending = self.current = self.last = self.reuse = None
        self.device.synchronize()


def placeholder(like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An empty tensor that fails loudly if a block's weight is used outside its forward."""
    return torch.empty(0, dtype=like.dtype, device=device)


def set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Point ``module.<name>`` (a parameter or buffer) at ``value``."""
    *path, leaf = name.split(".")
    for p in path:
        module = getattr(module, p)
    if leaf in module._parameters:
        param = module._parameters[leaf]
        if param is None or param.is_meta or param.device != value.device:
            module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        else:
            param.data = value
    else:
        module._buffers[leaf] = value
