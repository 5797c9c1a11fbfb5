"""``enable_layerwise_offload``: the library entry point, and the handle it returns.

Like diffusers' ``apply_group_offloading``, it takes a module and changes it in place:
non-block tensors become resident on the device, block tensors become empty
placeholders that a forward pre-hook points at a device slot for the block's forward.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import Checkpoint, CheckpointError, serving_dtype
from .comm import Device, Group
from .layout import BlockLayout, plan_block
from .runtime import HostBlocks, Ring, placeholder, set_tensor


@dataclass
class OffloadStats:
    """Counters of one offloaded module (per rank). Times in seconds, sizes in bytes."""

    mode: str
    rank: int
    world_size: int
    blocks: int
    forwards: int = 0
    idle_forwards: int = 0
    stall_s: float = 0.0  # time compute waited for weights, all forwards (CUDA: from events)
    last_forward_stall_s: float = 0.0  # CPU only; on CUDA events finish after the forward
    h2d_bytes: int = 0
    last_forward_h2d_bytes: int = 0
    gathered_bytes: int = 0
    last_forward_gathered_bytes: int = 0
    gather_s: float = 0.0  # time inside AllGathers (on a side stream/thread: overlaps compute)
    host_shard_bytes: int = 0
    host_pinned_bytes: int = 0
    device_slot_bytes: int = 0
    device_resident_bytes: int = 0
    device_peak_bytes: int = 0
    largest_block_bytes: int = 0
    block_bytes_by_dtype: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def find_blocks(module: nn.Module, block_attrs: Sequence[str] | None) -> list[tuple[str, nn.Module]]:
    """The blocks to stream, in run order, as (state_dict prefix, module)."""
    if block_attrs:
        lists = []
        for attr in block_attrs:
            try:
                ml = module.get_submodule(attr)
            except AttributeError as e:
                raise ValueError(f"block_attrs: module has no submodule {attr!r}") from e
            if not isinstance(ml, nn.ModuleList):
                raise ValueError(f"block_attrs: {attr!r} is {type(ml).__name__}, not a ModuleList")
            lists.append((attr, ml))
    else:
        candidates = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.ModuleList) and n]
        if not candidates:
            raise ValueError("module has no ModuleList of blocks; pass block_attrs")

        def size(m: nn.Module) -> int:
            return sum(p.numel() for p in m.parameters())

        lists = [max(candidates, key=lambda nm: size(nm[1]))]
    return [(f"{attr}.{i}.", blk) for attr, ml in lists for i, blk in enumerate(ml)]


def _expected(module: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict(keep_vars=True).items()}


def _place_non_persistent(module: nn.Module, dev: torch.device, persistent: Iterable[str]) -> None:
    keep = set(persistent)
    for name, buf in list(module.named_buffers()):
        if name in keep or buf is None:
            continue
        if buf.is_meta:
            raise CheckpointError(
                f"buffer {name!r} is not saved in checkpoints and is still on the meta device: "
                "build the module with accelerate.init_empty_weights() so buffers stay real"
            )
        set_tensor(module, name, buf.to(dev))


def load_resident(
    module: nn.Module,
    checkpoint: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    keep_fp32: Iterable[str] = (),
) -> nn.Module:
    """Load the whole checkpoint onto ``device`` (the fully resident reference).

    On CPU in the checkpoint's dtype the tensors stay zero-copy mmap views.
    """
    dev = torch.device(device)
    ckpt = Checkpoint(checkpoint)
    expected = _expected(module)
    ckpt.validate(expected)
    keep = tuple(keep_fp32)
    for key, rec in ckpt.records.items():
        set_tensor(module, key, ckpt.view(key).to(dev, serving_dtype(key, rec.dtype, dtype, keep)))
    _place_non_persistent(module, dev, expected)
    return module


class LayerwiseOffload:
    """What ``enable_layerwise_offload`` returns: idle replay, stats, close."""

    def __init__(
        self,
        module: nn.Module,
        checkpoint: str | os.PathLike,
        device: str | torch.device,
        group: dist.ProcessGroup | None,
        use_allgather: bool,
        block_attrs: Sequence[str] | None,
        dtype: torch.dtype | None,
        keep_fp32: Iterable[str],
        progress: Callable[[int, int], None] | None,
    ) -> None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.module = module
        self.group = Group.of(group)
        self.device = Device(dev, self.group)
        blocks = find_blocks(module, block_attrs)
        self.ckpt = Checkpoint(checkpoint)
        expected = _expected(module)
        self.ckpt.validate(expected)
        keep = tuple(keep_fp32)

        def dtype_of(key: str) -> torch.dtype:
            return serving_dtype(key, self.ckpt.records[key].dtype, dtype, keep)

        # Blocks: plan one flat layout each (same on every rank: state_dict order).
        layouts: list[BlockLayout] = []
        block_keys: list[dict[str, str]] = []
        in_block: set[str] = set()
        for i, (prefix, _) in enumerate(blocks):
            keys = {k[len(prefix) :]: k for k in expected if k.startswith(prefix)}
            if not keys:
                raise ValueError(f"block {prefix!r} has no parameters to offload")
            layouts.append(
                plan_block(i, prefix, ((n, dtype_of(k), self.ckpt.records[k].shape) for n, k in keys.items()))
            )
            block_keys.append(keys)
            in_block.update(keys.values())
        self.layouts = layouts

        # Non-block tensors: resident on the device.
        resident = 0
        for key in expected:
            if key not in in_block:
                t = self.ckpt.view(key).to(dev, dtype_of(key))
                set_tensor(module, key, t)
                resident += t.numel() * t.element_size()
        _place_non_persistent(module, dev, expected)
        for key in in_block:
            set_tensor(module, key, placeholder(torch.empty(0, dtype=dtype_of(key)), dev))

        self.host = HostBlocks(
            self.ckpt, layouts, block_keys, self.group, self.device, use_allgather, progress
        )
        world = self.group.world if use_allgather else 1
        slot_bytes = max(lay.padded_bytes(world) for lay in layouts)
        try:
            self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=dev) for _ in range(2)]
        except BaseException:  # e.g. device OOM: do not leave the host arena pinned
            self.host.close()
            self.device.close()
            raise
        self.ring = Ring(self.host, self.device, self.slots, self._count_fill)
        self._blocks = [blk for _, blk in blocks]
        self._placeholders = [
            {e.name: placeholder(torch.empty(0, dtype=e.dtype), dev) for e in lay.entries}
            for lay in layouts
        ]
        self._hooks = []
        self._entered = 0  # blocks entered in the module forward now running
        # Around the whole module: a forward that raises midway still makes every gather of
        # a forward, so the other ranks' collectives stay in step (see _finish_forward).
        self._hooks.append(module.register_forward_pre_hook(self._begin_forward))
        self._hooks.append(module.register_forward_hook(self._finish_forward, always_call=True))
        for i, blk in enumerate(self._blocks):
            self._hooks.append(blk.register_forward_pre_hook(self._pre_hook(i)))
            # always_call: a block that raises still gives its slot back
            self._hooks.append(blk.register_forward_hook(self._post_hook(i), always_call=True))

        by_dtype: dict[str, int] = {}
        for lay in layouts:
            for dt, n in lay.dtype_bytes.items():
                by_dtype[str(dt)] = max(by_dtype.get(str(dt), 0), n)
        self._stats = OffloadStats(
            mode="allgather" if use_allgather else "rank_local",
            rank=self.group.rank,
            world_size=self.group.world,
            blocks=len(layouts),
            host_shard_bytes=self.host.shard_bytes,
            host_pinned_bytes=self.host.pinned_bytes,
            device_slot_bytes=2 * slot_bytes,
            device_resident_bytes=resident,
            largest_block_bytes=max(lay.total_bytes for lay in layouts),
            block_bytes_by_dtype=by_dtype,
        )
        self._closed = False

    # -- hooks ------------------------------------------------------------------------

    def _enter(self, i: int, idle: bool) -> int:
        """Make block ``i``'s weights ready; returns the slot they are in."""
        st = self._stats
        if i == 0:
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
        p, waited = self.ring.acquire(i)
        if not self.device.is_cuda:  # on CUDA the stall comes from events (comm.Device)
            st.stall_s += waited
            st.last_forward_stall_s += waited
        return p.slot

    def _count_fill(self, lay: BlockLayout) -> None:
        st = self._stats
        if self.host.use_allgather:
            h2d = lay.shard_bytes(self.group.world) if self.device.is_cuda else 0
            gathered = lay.padded_bytes(self.group.world) if self.group.world > 1 else 0
        else:
            h2d, gathered = (lay.total_bytes if self.device.is_cuda else 0), 0
        st.h2d_bytes += h2d
        st.last_forward_h2d_bytes += h2d
        st.gathered_bytes += gathered
        st.last_forward_gathered_bytes += gathered

    def _pre_hook(self, i: int):  # noqa: ANN202
        lay = self.layouts[i]

        def hook(module: nn.Module, args: object) -> None:
            self._check_open()
            self._entered = i + 1
            slot = self.slots[self._enter(i, idle=False)]
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

    def _begin_forward(self, module: nn.Module, args: object) -> None:
        self._entered = 0

    def _finish_forward(self, module: nn.Module, args: object, output: object) -> None:
        """Replay the gathers of the blocks a raising forward never reached.

        Each rank makes the same collective calls in the same order: a forward that
        failed on one rank (a bad input, an OOM in block 3) would otherwise leave the
        others waiting in block 4's gather. After this the ring is back at block 0.
        """
        if self._closed or not self.host.collective or self._entered == len(self.layouts):
            return
        for i in range(self._entered, len(self.layouts)):
            self._enter(i, idle=True)
            self.ring.release()
        self._entered = len(self.layouts)

    # -- public -----------------------------------------------------------------------

    def idle_forwards(self, k: int) -> None:
        """Take part in every gather of ``k`` forwards without computing (idle replay).

        Where fills are not collectives (rank-local mode, or a single rank) there is
        nothing to take part in: the forwards are only counted.
        """
        self._check_open()
        if not self.host.collective:
            self._stats.idle_forwards += k
            return
        for _ in range(k):
            for i in range(len(self.layouts)):
                self._enter(i, idle=True)
                self.ring.release()

    def stats(self, sync: bool = True) -> OffloadStats:
        """Counters so far. ``sync`` waits for fills in flight so their times count; without
        it only finished work is counted (cheap enough to call between forwards)."""
        st = self._stats
        if sync:
            self.device.synchronize()
        st.gather_s += self.device.take_gather_s(block=sync)
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
        try:
            self.ring.drain()
        finally:
            for h in self._hooks:
                h.remove()
            self.device.close()
            self.host.close()
            self.slots.clear()
            self.ckpt.close()
            if self.device.is_cuda:
                torch.cuda.empty_cache()


def enable_layerwise_offload(
    module: nn.Module,
    checkpoint: str | os.PathLike,
    device: str | torch.device = "cuda",
    group: dist.ProcessGroup | None = None,
    use_allgather: bool = True,
    block_attrs: Sequence[str] | None = None,
    *,
    dtype: torch.dtype | None = None,
    keep_fp32: Iterable[str] = (),
    progress: Callable[[int, int], None] | None = None,
) -> LayerwiseOffload:
    """Stream ``module``'s blocks from host memory through two device slots.

    ``checkpoint`` keys are the module's own ``state_dict()`` names. ``dtype`` casts
    floating tensors while sharding (``keep_fp32`` names stay fp32); None serves the
    checkpoint's dtypes. ``progress(done, total)`` is called as blocks are sharded. Every
    rank of ``group`` must call this and then run the same number of forwards (or
    ``idle_forwards``) in the same order.
    """
    t0 = time.perf_counter()
    handle = LayerwiseOffload(
        module, checkpoint, device, group, use_allgather, block_attrs, dtype, keep_fp32, progress
    )
    handle.load_s = time.perf_counter() - t0
    return handle
