"""Resident blocks filled from the checkpoint straight into device memory, on several threads.

A resident block keeps a slot's flat layout (kernels see the same addresses modulo 256).
Its buffer used to be built on the host (a zeroed pageable buffer, each tensor copied in
from the mapped file, then one copy of the whole to the device): two passes over the bytes
on one thread; on an H200, 40 Wan-14B-shaped blocks (28 GB) took 9 s of a start. Now the
buffer is made and zeroed on the device (the padding between tensors stays the same bytes
on every rank and run) and each tensor is copied into its place from the mapped file,
blocks spread over worker threads with a CUDA stream each: torch's copies release the GIL,
and a copy from pageable memory holds its thread until it is done. A tensor whose stored
dtype differs is cast on the host first, as before, so the bytes on the device are the same.
The copies run behind the load (``ResidentFill``): the compile warm-up runs beside them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

import torch

from .layout import BlockLayout

MAX_WORKERS = 8  # copy threads at most; fewer where torch was given fewer


class ResidentFill:
    """Resident blocks' device buffers, made and zeroed at once, filled on threads behind:
    ``buffers`` may be placed in the model now, and read once ``wait`` said so (a forward
    that needs block k waits for it alone: the compile warm-up overlaps the rest)."""

    def __init__(self, blocks: Sequence[tuple[BlockLayout, dict[str, str]]],
                 view: Callable[[str], torch.Tensor], dev: torch.device, workers: int | None = None) -> None:
        self.buffers = [torch.zeros(lay.total_bytes, dtype=torch.uint8, device=dev) for lay, _ in blocks]
        self._done = 0
        self._futures: list[Future[None]] = []
        self._pool: ThreadPoolExecutor | None = None
        if not blocks:
            return
        n = workers or max(1, min(MAX_WORKERS, torch.get_num_threads(), len(blocks)))
        after = torch.cuda.Event() if dev.type == "cuda" else None
        if after is not None:
            after.record(torch.cuda.current_stream(dev))  # the zeroing: copies go after it

        def one(k: int) -> None:
            lay, keys = blocks[k]
            stream = torch.cuda.Stream(dev) if after is not None else None
            if stream is not None:
                stream.wait_event(after)
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                for e in lay.entries:
                    src = view(keys[e.name])
                    e.view(self.buffers[k]).copy_(src if src.dtype == e.dtype else src.to(e.dtype))
            if stream is not None:
                stream.synchronize()

        self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="fill-resident")
        self._futures = [self._pool.submit(one, k) for k in range(len(blocks))]  # in block order

    def wait(self, k: int | None = None) -> None:
        """Until block ``k`` (its index in ``blocks``) is filled, or with None all of them;
        a copy's error is raised here."""
        if k is not None:
            self._futures[k].result()
            return
        try:
            for f in self._futures:
                f.result()
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Stop the copies not begun and wait for the rest (the buffers are being dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def fill_blocks(blocks: Sequence[tuple[BlockLayout, dict[str, str]]], view: Callable[[str], torch.Tensor],
                dev: torch.device, workers: int | None = None) -> list[torch.Tensor]:
    """One flat uint8 buffer on ``dev`` per ``(layout, {entry name: checkpoint key})``, in
    order, each tensor read through ``view`` (the checkpoint's mapped tensor by key)."""
    fill = ResidentFill(blocks, view, dev, workers)
    fill.wait()
    return fill.buffers
