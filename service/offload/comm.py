"""Where the device kind is decided: gather, copy and wait primitives for CPU and CUDA.

Everything that differs between a CPU/gloo run and a CUDA/NCCL run lives here, so the
runtime above has one code path and CI exercises the real logic on CPU.

- CUDA: a side stream does the H2D copy of the rank's shard into its chunk of the slot,
  then an in-place ``all_gather_into_tensor`` (NCCL); a CUDA event marks the slot ready
  and the compute stream waits on it. The host does not block on gathers (in rank-local
  mode it waits for the pack thread).
- CPU: the slot is host memory. Gathers run as gloo async work (gloo's own threads);
  rank-local packing runs on one background thread. Waiting means joining that work.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly (CUDA >= 11.1)

# torch 2.13 renamed all_gather_into_tensor; the GPU image still has 2.11.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class Group:
    """The N ranks that share one model: a process group, or a single rank."""

    pg: dist.ProcessGroup | None = None
    rank: int = 0
    world: int = 1

    @classmethod
    def of(cls, pg: dist.ProcessGroup | None) -> Group:
        if pg is None:
            return cls()
        return cls(pg, dist.get_rank(pg), dist.get_world_size(pg))


@dataclass
class Pending:
    """A slot fill in flight; ``wait`` makes the compute side wait for it."""

    block: int
    slot: int
    _wait: Callable[[], object] | None

    def wait(self) -> None:
        """Block compute until the slot is ready (the host, or on CUDA the compute stream)."""
        if self._wait is not None:
            self._wait()
            self._wait = None  # the finished work holds its input shard: let it go


@dataclass
class Device:
    """Streams, events and worker threads for one device; the only place that branches."""

    device: torch.device
    group: Group
    _side: torch.cuda.Stream | None = None
    _ready: list[torch.cuda.Event] = field(default_factory=list)
    _free: list[torch.cuda.Event] = field(default_factory=list)
    _staged: list[torch.cuda.Event] = field(default_factory=list)
    _pool: ThreadPoolExecutor | None = None
    _stall_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    _last_end: torch.cuda.Event | None = None
    _gather_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    _gather_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # Ring positions that start a forward (block 0; and each expert's first block): their stall
    # is measured from their own wait, not from the end of the previous block's compute.
    firsts: frozenset[int] = frozenset({0})

    def __post_init__(self) -> None:
        if self.is_cuda:
            self._side = torch.cuda.Stream(self.device)
            self._ready = [torch.cuda.Event() for _ in range(2)]
            self._free = [torch.cuda.Event() for _ in range(2)]
            self._staged = [torch.cuda.Event() for _ in range(2)]

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """Page-lock host memory in place (exact size, unlike the caching host allocator)."""
        if self.is_cuda and t.numel():
            rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister of {t.nbytes} bytes failed ({rc})")
        return t

    def register_readonly(self, t: torch.Tensor) -> str | None:
        """Register a read-only file mapping for DMA (the copy engine reads the page cache).

        None on success, else why not (no CUDA, or the driver refused: an old kernel or
        driver without cudaHostRegisterReadOnly support, a locked-memory limit, ...).
        """
        if not self.is_cuda:
            return "not a CUDA device"
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), HOST_REGISTER_READ_ONLY)
        if int(rc) != 0:
            _clear_last_cuda_error()  # or a later kernel-launch check reports this one
            return f"cudaHostRegister(read-only) of {t.numel()} bytes failed: {rc}"
        return None

    def unpin(self, t: torch.Tensor) -> None:
        if self.is_cuda and t.numel():
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())

    def _thread(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dlo-pack")
        return self._pool

    # -- filling a slot ---------------------------------------------------------------

    def gather(self, block: int, slot: int, out: torch.Tensor, shard: torch.Tensor) -> Pending:
        """Fill ``out`` (N shards) with every rank's ``shard`` of ``block``."""
        g = self.group
        if self.is_cuda:
            chunk = out.narrow(0, g.rank * shard.numel(), shard.numel())
            side = self._side
            assert side is not None
            with torch.cuda.stream(side):
                side.wait_event(self._free[slot])
                chunk.copy_(shard, non_blocking=True)
                if g.world > 1:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(side)
                    all_gather(out, chunk, group=g.pg)
                    end.record(side)
                    self._gather_events.append((start, end))
                self._ready[slot].record(side)
            return Pending(block, slot, self._cuda_wait(slot, block))
        if g.world == 1:
            out.copy_(shard)
            return Pending(block, slot, None)
        t0 = time.perf_counter()
        work = all_gather(out, shard, group=g.pg, async_op=True)
        assert work is not None
        work.get_future().add_done_callback(lambda _: self._add_gather(time.perf_counter() - t0))
        return Pending(block, slot, work.wait)

    def copy_in(self, block: int, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Pending:
        """Fill a slot by DMA from registered host memory, one copy per (dst, src) pair (CUDA)."""
        side = self._side
        assert side is not None
        with torch.cuda.stream(side):
            side.wait_event(self._free[slot])
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            self._ready[slot].record(side)
        return Pending(block, slot, self._cuda_wait(slot, block))

    def _add_gather(self, seconds: float) -> None:
        with self._lock:
            self._gather_s += seconds

    def stage(
        self,
        block: int,
        slot: int,
        out: torch.Tensor,
        staging: torch.Tensor | None,
        pack: Callable[[torch.Tensor], None],
    ) -> Pending:
        """Fill ``out`` by ``pack``-ing host tensors (rank-local mode), off the main thread.

        On CUDA ``pack`` writes the pinned ``staging`` buffer and the side stream copies
        it to ``out``; on CPU ``pack`` writes ``out`` directly.
        """
        if not self.is_cuda:
            fut = self._thread().submit(pack, out)
            return Pending(block, slot, fut.result)
        assert staging is not None and self._side is not None
        side, staged, free, ready = self._side, self._staged[slot], self._free[slot], self._ready[slot]

        def job() -> None:
            staged.synchronize()  # the previous H2D out of this staging buffer is done
            pack(staging)
            with torch.cuda.stream(side):
                side.wait_event(free)
                out.copy_(staging, non_blocking=True)
                staged.record(side)
                ready.record(side)

        fut: Future[None] = self._thread().submit(job)

        def wait() -> None:
            fut.result()
            self._cuda_wait(slot, block)()

        return Pending(block, slot, wait)

    def _cuda_wait(self, slot: int, block: int) -> Callable[[], None]:
        def wait() -> None:
            compute = torch.cuda.current_stream(self.device)
            # The stall of a block is the gap since the previous block's compute ended:
            # a late host (rank-local pack) shows there as well as a late slot. Block 0
            # starts after the non-block layers, so it measures from its own wait.
            start = self._last_end if block not in self.firsts else None
            if start is None:
                start = torch.cuda.Event(enable_timing=True)
                start.record(compute)
            compute.wait_event(self._ready[slot])
            after = torch.cuda.Event(enable_timing=True)
            after.record(compute)
            self._stall_events.append((start, after))

        return wait

    def release(self, slot: int) -> None:
        """Compute is done with ``slot``; the next fill of it may start after this point."""
        if self.is_cuda:
            compute = torch.cuda.current_stream(self.device)
            self._free[slot].record(compute)
            self._last_end = torch.cuda.Event(enable_timing=True)
            self._last_end.record(compute)

    def device_stall_s(self, block: bool = False) -> float:
        """Seconds the compute stream sat waiting for weights (CUDA), from finished events."""
        total, self._stall_events = _fold(self._stall_events, block)
        return total

    def take_gather_s(self, block: bool = False) -> float:
        """Seconds spent inside AllGathers since the last call (overlapped with compute)."""
        total, self._gather_events = _fold(self._gather_events, block)
        with self._lock:
            total, self._gather_s = total + self._gather_s, 0.0
        return total

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _clear_last_cuda_error() -> None:
    """``cudaGetLastError`` of the CUDA runtime torch loaded (torch does not expose it)."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError):
        pass


def _fold(
    pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]], block: bool
) -> tuple[float, list[tuple[torch.cuda.Event, torch.cuda.Event]]]:
    """Sum the elapsed seconds of finished (start, end) event pairs; keep the rest."""
    total, keep = 0.0, []
    for start, end in pairs:
        if block:
            end.synchronize()
        if end.query():
            total += start.elapsed_time(end) / 1000.0
        else:
            keep.append((start, end))
    return total, keep
