"""``enable_layerwise_offload``: the library entry point, and the handle it returns.

Like diffusers' ``apply_group_offloading``, it takes a module and changes it in place:
non-block tensors become resident on the device, block tensors become empty
placeholders that a forward pre-hook points at a device slot for the block's forward.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import Checkpoint, CheckpointPath, compute_aligned, serving_dtype
from .comm import Device, Group
from .fill import ResidentFill
from .layout import BlockLayout, plan_block
from .mode import OffloadMode, streamed_mode
from .modules import _back_to, _expected, _place_non_persistent, _to_host, find_blocks, load_resident
from .options import OffloadStats, Placement
from .plan import plan_resident
from .quant import Fp8
from .quant_checkpoint import quantize_module
from .runtime import HostBlocks, Ring, placeholder, set_tensor

__all__ = ["LayerwiseOffload", "OffloadStats", "Placement", "enable_layerwise_offload", "find_blocks",
           "load_resident"]


class LayerwiseOffload:
    """What ``enable_layerwise_offload`` returns: idle replay, stats, close.

    Set-up runs in named phases: plan (layouts, resident set), place (device-resident
    tensors, host-kept modules, placeholders), host (shards or page cache, slots), hooks.

    ``experts``: submodules of ``module`` that each run as a forward of their own (the two
    denoisers of a Wan2.2 pipeline). Their blocks share the host arena, the two slots and
    the ring; only the expert that runs has its blocks filled, and ``expect`` says which
    expert comes next so its first block is prefetched before the switch.
    """

    def __init__(
        self,
        module: nn.Module,
        checkpoint: CheckpointPath,
        device: str | torch.device,
        group: dist.ProcessGroup | None,
        mode: OffloadMode | str,
        block_attrs: Sequence[str] | None,
        dtype: torch.dtype | None,
        keep_fp32: Iterable[str],
        progress: Callable[[int, int], None] | None,
        options: Placement | None = None,
        quantization: str | Fp8 | None = None,
        experts: Sequence[str] | None = None,
    ) -> None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        opts = options or Placement()
        mode = streamed_mode(mode)
        self.module = module
        self.group = Group.of(group)
        self.device = Device(dev, self.group)
        self.ckpt = Checkpoint(checkpoint)
        blocks = find_blocks(module, block_attrs)
        self.quant = quantize_module(module, blocks, self.ckpt, quantization, dev)
        keep = tuple(keep_fp32) + (self.quant.keep_fp32 if self.quant else ())
        self._plan(blocks, dtype, keep, opts, mode)
        resident = self._place(dev, opts)
        self._streamed = [i for i in range(len(self.layouts)) if i not in self.plan.resident]
        self.experts = tuple(experts or ())
        self._segments = self._segment(blocks)
        if opts.free_slots and self.experts:
            raise ValueError("free_slots is for a module run once per request, not for experts")
        if opts.free_slots and mode.gathers and self.group.world > 1 and self._streamed:
            raise ValueError("free_slots needs a module whose fills are not collectives")
        self.host = HostBlocks(
            self.ckpt,
            [self.layouts[i] for i in self._streamed],
            [self._block_keys[i] for i in self._streamed],
            self.group,
            self.device,
            mode,
            progress,
            pagecache=opts.pagecache,
        )
        world = self.group.world if mode.gathers else 1
        slot_bytes = max((self.layouts[i].padded_bytes(world) for i in self._streamed), default=0)
        self._slot_bytes, self._free_slots = slot_bytes, opts.free_slots
        try:
            self.slots = [torch.empty(0 if opts.free_slots else slot_bytes, dtype=torch.uint8, device=dev)
                          for _ in range(2)] if self._streamed else []
        except BaseException:  # e.g. device OOM: do not leave the host arena pinned
            self.host.close()
            self.device.close()
            raise
        self.ring = Ring(self.host, self.device, self.slots, self._count_fill, self._segments)
        self._starts = frozenset(lo for lo, hi in self._segments if lo < hi)
        self.device.firsts = self._starts or frozenset({0})
        self._register_hooks()
        by_dtype: dict[str, int] = {}
        for lay in self.layouts:
            for dt, n in lay.dtype_bytes.items():
                by_dtype[str(dt)] = max(by_dtype.get(str(dt), 0), n)
        self._stats = OffloadStats(
            mode=mode.value,
            rank=self.group.rank,
            world_size=self.group.world,
            blocks=len(self.layouts),
            resident_blocks=len(self.plan.resident),
            rank_local_source=self.host.source,
            source_reason=self.host.source_reason,
            host_shard_bytes=self.host.shard_bytes,
            host_pinned_bytes=self.host.pinned_bytes,
            host_registered_bytes=self.host.registered_bytes,
            device_slot_bytes=2 * slot_bytes if self._streamed else 0,
            device_resident_bytes=resident,
            device_resident_block_bytes=self.plan.resident_bytes,
            device_budget_bytes=opts.device_memory_budget or 0,
            activation_bytes=opts.activation_bytes,
            largest_block_bytes=max(lay.total_bytes for lay in self.layouts),
            block_bytes_by_dtype=by_dtype,
            experts=max(1, len(self.experts)),
            expert_forwards=[0] * max(1, len(self.experts)),
            **(self.quant.stats() if self.quant else {}),
        )
        self._closed = False

    # -- set-up phases --------------------------------------------------------------------

    def _plan(
        self,
        blocks: list[tuple[str, nn.Module]],
        dtype: torch.dtype | None,
        keep: tuple[str, ...],
        opts: Placement,
        mode: OffloadMode,
    ) -> None:
        """Validate the checkpoint, lay out every block, choose the resident blocks."""
        module = self.module
        expected = _expected(module)
        for alias, source in opts.tied.items():
            if alias not in expected or source not in expected:
                raise ValueError(f"tied: {alias!r} -> {source!r} names a tensor the module does not have")
        self._expected = expected
        self.ckpt.validate({k: v for k, v in expected.items() if k not in opts.tied})
        self._dtype_of = lambda key: serving_dtype(key, self.ckpt.records[key].dtype, dtype, keep)
        host_keys = set()
        for name in opts.host_modules:
            sub = module.get_submodule(name)
            if not isinstance(sub, nn.Embedding):
                raise ValueError(f"host_modules: {name!r} is {type(sub).__name__}; only nn.Embedding "
                                 "runs on the host (a lookup is exact on any device)")
            host_keys.update(f"{name}.{k}" for k in sub.state_dict())
        self._host_keys = host_keys
        layouts: list[BlockLayout] = []
        self._block_keys: list[dict[str, str]] = []
        in_block: set[str] = set()
        for i, (prefix, _) in enumerate(blocks):
            keys = {k[len(prefix) :]: k for k in expected if k.startswith(prefix) and k not in opts.tied}
            if not keys:
                raise ValueError(f"block {prefix!r} has no parameters to offload")
            layouts.append(
                plan_block(i, prefix, ((n, self._dtype_of(k), self.ckpt.records[k].shape)
                                       for n, k in keys.items()))
            )
            self._block_keys.append(keys)
            in_block.update(keys.values())
        self.layouts = layouts
        self._blocks = [blk for _, blk in blocks]
        self._in_block = in_block
        non_block = sum(
            math.prod(self.ckpt.records[k].shape) * self._dtype_of(k).itemsize
            for k in expected
            if k not in in_block and k not in host_keys and k not in opts.tied
        )
        world = self.group.world if mode.gathers else 1
        self.plan = plan_resident(
            [lay.total_bytes for lay in layouts],
            [lay.padded_bytes(world) for lay in layouts],
            resident_blocks=opts.resident_blocks,
            budget=opts.device_memory_budget,
            fixed_bytes=non_block + opts.activation_bytes,
        )

    def _segment(self, blocks: list[tuple[str, nn.Module]]) -> list[tuple[int, int]]:
        """[lo, hi) ring positions of each expert's streamed blocks (one range without experts)."""
        if not self.experts:
            self._expert_first = [0]
            return [(0, len(self._streamed))]
        owner = []
        for prefix, _ in blocks:
            names = [e for e in self.experts if prefix.startswith(f"{e}.")]
            if len(names) != 1:
                raise ValueError(f"experts: block {prefix!r} belongs to {names or 'none'} of "
                                 f"{list(self.experts)}")
            owner.append(self.experts.index(names[0]))
        if owner != sorted(owner):
            raise ValueError(f"experts: each expert's blocks must be one run in block order, got {owner}")
        self._expert_first = [owner.index(e) if e in owner else 0 for e in range(len(self.experts))]
        streamed = [owner[i] for i in self._streamed]  # non-decreasing: one run per expert
        out, lo = [], 0
        for e in range(len(self.experts)):
            out.append((lo, lo + streamed.count(e)))
            lo = out[-1][1]
        return out

    def _place(self, dev: torch.device, opts: Placement) -> int:
        """Put non-block tensors and resident blocks on the device; returns their bytes."""
        module, placed = self.module, 0
        for key in self._expected:
            if key in self._in_block or key in opts.tied:
                continue
            if key in self._host_keys:  # served from the mmap view (a copy only if cast)
                set_tensor(module, key, compute_aligned(self.ckpt.view(key).to(dtype=self._dtype_of(key))))
                continue
            t = compute_aligned(self.ckpt.view(key).to(dev, self._dtype_of(key)))
            set_tensor(module, key, t)
            placed += t.numel() * t.element_size()
        _place_non_persistent(module, dev, self._expected)
        tensors = module.state_dict(keep_vars=True)
        for alias, source in opts.tied.items():
            set_tensor(module, alias, tensors[source])
        resident = [i for i in range(len(self.layouts)) if i in self.plan.resident]
        # a slot's flat layout, zero padded, filled on threads straight from the file (offload.fill)
        self._fill: ResidentFill | None = ResidentFill(
            [(self.layouts[i], self._block_keys[i]) for i in resident], self.ckpt.view, dev)
        self._resident_buffers = self._fill.buffers
        self._fill_hooks = [self._blocks[i].register_forward_pre_hook(partial(_wait_fill, self._fill, k))
                            for k, i in enumerate(resident)]
        self._fill_release = [self._block_keys[i].values() for i in resident]
        if not opts.fill_behind:
            self.wait_resident()
        filled = dict(zip(resident, self._resident_buffers, strict=True))
        for i, lay in enumerate(self.layouts):
            blk = self._blocks[i]
            if i in filled:
                for e in lay.entries:
                    set_tensor(blk, e.name, e.view(filled[i]))
                placed += lay.total_bytes
            else:
                for e in lay.entries:
                    set_tensor(blk, e.name, placeholder(torch.empty(0, dtype=e.dtype), dev))
        self._host_hooks = []
        for name in opts.host_modules:
            sub = module.get_submodule(name)
            self._host_hooks.append(sub.register_forward_pre_hook(_to_host))
            self._host_hooks.append(sub.register_forward_hook(_back_to(dev)))
        return placed

    def wait_resident(self) -> None:
        """Until every resident block is filled (``Placement.fill_behind``: before serving);
        a copy's error is raised here."""
        fill, self._fill = self._fill, None
        if fill is None:
            return
        fill.wait()
        for h in self._fill_hooks:
            h.remove()
        for keys in self._fill_release:  # their mapped pages: read, no longer needed
            self.ckpt.release(keys)
        self._fill_hooks, self._fill_release = [], []

    def _register_hooks(self) -> None:
        module = self.module
        dev = self.device.device
        self._placeholders = {
            i: {e.name: placeholder(torch.empty(0, dtype=e.dtype), dev) for e in self.layouts[i].entries}
            for i in self._streamed
        }
        self._hooks = list(self._host_hooks)
        # Streamed blocks entered in the module forward now running; between forwards all of
        # them, so a forward stopped before it began (a hook ahead of ours raised) replays none.
        self._entered = len(self._streamed)
        self._stopped = False  # this forward stopped at a decision point (step caches)
        # Streamed position -> its block index within its expert (the module that runs).
        self._decide_at: dict[int, int] = {}
        self._agree_pg: dist.ProcessGroup | None = self.group.pg
        self._vote: Callable[[int], bool] | None = None
        # Around the whole module (each expert): a forward that raises midway still makes every
        # gather of a forward, so the other ranks' collectives stay in step (_finish_forward).
        self._active: int | None = None  # the segment whose forward is running
        for seg, sub in enumerate([module.get_submodule(e) for e in self.experts] or [module]):
            self._hooks.append(sub.register_forward_pre_hook(partial(self._begin_forward, seg)))
            finish = partial(self._finish_forward, seg)
            self._hooks.append(sub.register_forward_hook(finish, always_call=True))
        for pos, i in enumerate(self._streamed):
            blk = self._blocks[i]
            self._hooks.append(blk.register_forward_pre_hook(self._pre_hook(pos, i)))
            # always_call: a block that raises still gives its slot back
            self._hooks.append(blk.register_forward_hook(self._post_hook(i), always_call=True))

    # -- hooks ------------------------------------------------------------------------

    def _forward_start(self, pos: int, idle: bool) -> None:
        """Counters of a forward that reaches its first streamed block ``pos`` (real or replayed)."""
        st = self._stats
        if self.experts:
            st.expert_forwards[self.ring._segment_of[pos]] += 1
        st.gather_s += self.device.take_gather_s(block=False)  # keep event lists short
        if self.device.is_cuda:
            st.stall_s += self.device.device_stall_s(block=False)
        if idle:
            st.idle_forwards += 1
        else:
            st.forwards += 1
        st.last_forward_stall_s = 0.0
        st.last_forward_h2d_bytes = 0
        st.last_forward_gathered_bytes = 0
        self._stopped = False

    def _enter(self, i: int) -> int:
        """Make streamed block ``i`` (position in the ring) ready; returns its slot."""
        st = self._stats
        reused = self.ring.reuse
        p, waited = self.ring.acquire(i)
        if reused is not None and p is reused:
            st.blocks_reused += 1
            st.fill_bytes_skipped += self.layouts[self._streamed[i]].total_bytes
        if not self.device.is_cuda:  # on CUDA the stall comes from events (comm.Device)
            st.stall_s += waited
            st.last_forward_stall_s += waited
        return p.slot

    # -- step caches: forwards that stop early ------------------------------------------

    def enable_skips(self, points: Iterable[int], agree_group: dist.ProcessGroup | None = None) -> None:
        """Let a forward stop before block ``p`` (a block index) for each ``p`` in ``points``.

        With experts each expert's forward is one segment of the ring and ``p`` is a block
        index within the expert: the decision points are the first two streamed blocks of
        the segment that runs.

        At the first streamed block at or after ``p`` every rank asks ``vote(block)`` (set
        with ``set_vote``; None: yes) whether it will run that block. In an AllGather group
        the ranks agree (an all-reduce of one flag, over ``agree_group`` if given: a gloo
        group of the same ranks keeps it off the device): the forward goes on if any rank
        needs it, and the others replay its fills; if none does, no rank fills the rest. A
        stopped forward keeps its slots for the next one (``Ring.stop``), so decisions may sit
        only at the first two streamed blocks. Every rank must pass the same points.
        """
        by_pos: dict[int, int] = {}
        for seg, (lo, hi) in enumerate(self._segments):
            base = self._expert_first[seg]  # block index of the expert's first block
            for p in points:
                pos = next((q for q in range(lo, hi) if self._streamed[q] - base >= p), None)
                if pos is None:
                    continue  # nothing streamed from there on: nothing to save
                if pos - lo > 1:
                    raise ValueError(f"a forward can stop before its first or second streamed block; "
                                     f"block {p} is streamed position {pos - lo}")
                by_pos[pos] = self._streamed[pos] - base
        self._decide_at = by_pos
        self._agree_pg = agree_group if agree_group is not None else self.group.pg

    def set_vote(self, vote: Callable[[int], bool] | None) -> None:
        """``vote(block)``: whether this rank's forward runs ``block`` (asked at decision points;
        a block index within the module that runs, the expert with experts)."""
        self._vote = vote

    def _agree(self, need: bool) -> bool:
        if not self.host.collective:
            return need
        t0 = time.perf_counter()
        pg = self._agree_pg
        dev = torch.device("cpu") if dist.get_backend(pg) == "gloo" else self.device.device
        flag = torch.tensor([int(need)], dtype=torch.int32, device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pg)
        out = bool(flag.item())
        self._stats.skip_agree_s += time.perf_counter() - t0
        return out

    def _decide(self, pos: int, need: bool) -> bool:
        """At a decision point: whether the forward goes on (False: it stopped here)."""
        st = self._stats
        st.skip_decisions += 1
        go = self._agree(need)
        if go:
            st.skip_overruled += int(not need)
            return True
        lo, hi = self._segments[self.ring._segment_of[pos]]
        self.ring.stop(lo)
        self._stopped = True
        st.skips += 1
        rest = [self.layouts[i].total_bytes for i in self._streamed[pos:hi]]
        st.blocks_skipped += len(rest)
        st.fill_bytes_skipped += sum(rest)
        return False

    def _replay(self, segment: int, start: int, idle: bool = True) -> None:
        """Take part in the fills of streamed positions ``start``.. of one forward of ``segment``,
        computing nothing (voting no at every decision point): an idle rank, or the rest of a
        forward that raised or did not call its remaining blocks (``idle=False``: it counts as one)."""
        lo, hi = self._segments[segment]
        for pos in range(start, hi):
            if pos == lo:
                self._forward_start(pos, idle=idle)
            if self._stopped or (pos in self._decide_at and not self._decide(pos, False)):
                return
            self._enter(pos)
            self.ring.release()

    def _count_fill(self, lay: BlockLayout) -> None:
        st = self._stats
        st.fills += 1
        st.fill_bytes += lay.total_bytes
        if self.host.gathers:
            h2d = lay.shard_bytes(self.group.world) if self.device.is_cuda else 0
            gathered = lay.padded_bytes(self.group.world) if self.group.world > 1 else 0
        else:
            h2d, gathered = (lay.total_bytes if self.device.is_cuda else 0), 0
        st.h2d_bytes += h2d
        st.last_forward_h2d_bytes += h2d
        st.gathered_bytes += gathered
        st.last_forward_gathered_bytes += gathered

    def _pre_hook(self, pos: int, i: int):  # noqa: ANN202
        lay = self.layouts[i]

        def hook(module: nn.Module, args: object) -> None:
            self._check_open()
            self._entered = pos + 1
            if pos in self._starts:
                self._forward_start(pos, idle=False)
            if self._stopped:
                return  # the group stopped this forward: the block keeps its placeholders
            if pos in self._decide_at:
                need = self._vote is None or self._vote(self._decide_at[pos])
                if not self._decide(pos, need):
                    return
            slot = self.slots[self._enter(pos)]
            for e in lay.entries:
                set_tensor(module, e.name, e.view(slot))

        return hook

    def _post_hook(self, i: int):  # noqa: ANN202
        empty = self._placeholders[i]

        def hook(module: nn.Module, args: object, output: object) -> None:
            for name, ph in empty.items():
                set_tensor(module, name, ph)
            self.ring.release()

        return hook

    def _begin_forward(self, segment: int, module: nn.Module, args: object) -> None:
        self._active = segment
        self._entered = self._segments[segment][0]
        self._stopped = False
        if self._free_slots and self._streamed and not self.slots[0].numel():
            self.slots[:] = [torch.empty(self._slot_bytes, dtype=torch.uint8, device=self.device.device)
                             for _ in range(2)]
        if self._streamed:
            self.ring.begin(segment)  # a prefetch of another expert's block is refilled here
        lo, hi = self._segments[segment]
        if lo == hi:  # nothing streamed: no ring to count forwards
            self._stats.forwards += 1

    def _finish_forward(self, segment: int, module: nn.Module, args: object, output: object) -> None:
        """Replay the gathers of the blocks a raising forward never reached.

        Each rank makes the same collective calls in the same order: a forward that
        failed on one rank (a bad input, an OOM in block 3) would otherwise leave the
        others waiting in block 4's gather. After this the ring is back at block 0. A model
        that skips blocks without calling them (a step cache) is caught up here the same way.
        """
        if self._active != segment:  # a hook ahead of ours stopped it before it began
            return
        self._active = None
        lo, n = self._segments[segment]
        if self._free_slots and not self._closed and self._streamed:
            self.ring.reset()  # the prefetch of block 0 is dropped with the slots
            self.slots[:] = [torch.empty(0, dtype=torch.uint8, device=self.device.device) for _ in range(2)]
        if self._closed or self._entered == n:
            return
        if self.host.collective:
            self._replay(segment, self._entered, idle=False)
        elif self._entered in self._decide_at and not self._stopped:
            # A model that did not call the blocks it skipped: the stop is recorded here.
            if self._entered == lo:
                self._forward_start(lo, idle=False)
            self._decide(self._entered, False)
        self._entered = n

    # -- public -----------------------------------------------------------------------

    def idle_forwards(self, k: int, expert: int = 0) -> None:
        """Take part in every gather of ``k`` forwards (of ``expert``) without computing.

        Where fills are not collectives (rank-local mode, or a single rank) there is
        nothing to take part in: the forwards are only counted.
        """
        self._check_open()
        lo, hi = self._segments[expert]
        if not self.host.collective or lo == hi:
            self._stats.idle_forwards += k
            return
        for _ in range(k):
            self.ring.begin(expert)
            self._replay(expert, lo)

    def expect(self, expert: int) -> None:
        """The expert whose forward comes after the current one: its first block is the fill
        after the current expert's last. Every rank of a group must expect the same (a wrong
        guess costs a dropped fill, never a wrong weight: ``begin`` refills)."""
        if not 0 <= expert < len(self._segments):
            raise ValueError(f"expert {expert} out of range ({len(self._segments)} experts)")
        if self._streamed:
            self.ring.expect(expert)

    def stats(self, sync: bool = True) -> OffloadStats:
        """Counters so far. ``sync`` waits for fills in flight so their times count; without
        it only finished work is counted (cheap enough to call between forwards)."""
        st = self._stats
        if sync:
            self.device.synchronize()
        st.gather_s += self.device.take_gather_s(block=sync)
        st.prefetch_redirects = self.ring.redirects
        if self.device.is_cuda:
            stall = self.device.device_stall_s(block=sync)
            st.stall_s += stall
            st.device_peak_bytes = torch.cuda.max_memory_allocated(self.device.device)
        else:
            st.device_peak_bytes = st.device_slot_bytes + st.device_resident_bytes
        return OffloadStats(**asdict(st))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("layerwise offload handle is closed")

    def close(self) -> None:
        """Free pinned host memory and device slots; the module is unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        fill, self._fill = getattr(self, "_fill", None), None
        if fill is not None:  # closed while the copies ran: let them end first
            fill.cancel()
        try:
            self.ring.drain()
        finally:
            for h in self._hooks:
                h.remove()
            self.device.close()
            self.host.close()
            self.slots.clear()
            self._resident_buffers.clear()
            self.ckpt.close()
            if self.device.is_cuda:
                torch.cuda.empty_cache()


def _wait_fill(fill: ResidentFill, k: int, _module: nn.Module, _args: object) -> None:
    """A resident block's pre-forward hook while the fill runs behind: its bytes first."""
    fill.wait(k)


def enable_layerwise_offload(
    module: nn.Module,
    checkpoint: CheckpointPath,
    device: str | torch.device = "cuda",
    group: dist.ProcessGroup | None = None,
    mode: OffloadMode | str = OffloadMode.ALLGATHER,
    block_attrs: Sequence[str] | None = None,
    *,
    dtype: torch.dtype | None = None,
    keep_fp32: Iterable[str] = (),
    progress: Callable[[int, int], None] | None = None,
    placement: Placement | None = None,
    quantization: str | Fp8 | None = None,
    experts: Sequence[str] | None = None,
) -> LayerwiseOffload:
    """Stream ``module``'s blocks from host memory through two device slots.

    ``checkpoint`` keys are the module's own ``state_dict()`` names. ``dtype`` casts
    floating tensors while sharding (``keep_fp32`` names stay fp32); None serves the
    checkpoint's dtypes. ``progress(done, total)`` is called as blocks are sharded. Every
    rank of ``group`` must call this and then run the same number of forwards (or
    ``idle_forwards``) in the same order. ``placement`` keeps blocks resident, ties
    weights, keeps embeddings on the host, picks the rank-local source (see Placement);
    every rank of an AllGather group must pass the same resident set. ``quantization``
    ``"fp8"`` (or ``quant.Fp8(compute=...)``) serves the blocks' Linear weights in fp8, from a
    bf16/fp32 checkpoint (quantized while sharding) or one written by ``write_quantized``.
    ``experts`` names submodules that each run a forward of their own over their share of
    the blocks (see LayerwiseOffload); ``checkpoint`` is then a mapping of key prefix ->
    checkpoint (``{"transformer.": ..., "transformer_2.": ...}``).
    """
    t0 = time.perf_counter()
    handle = LayerwiseOffload(
        module, checkpoint, device, group, mode, block_attrs, dtype, keep_fp32, progress, placement,
        quantization, experts,
    )
    handle.load_s = time.perf_counter() - t0
    return handle
