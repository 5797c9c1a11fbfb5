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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import torch

from .layout import BlockLayout

MAX_WORKERS = 8  # copy threads at most; fewer where torch was given fewer


def fill_blocks(blocks: Sequence[tuple[BlockLayout, dict[str, str]]], view: Callable[[str], torch.Tensor],
                dev: torch.device, workers: int | None = None) -> list[torch.Tensor]:
    """One flat uint8 buffer on ``dev`` per ``(layout, {entry name: checkpoint key})``, in
    order, each tensor read through ``view`` (the checkpoint's mapped tensor by key)."""
    if not blocks:
        return []
    n = workers or max(1, min(MAX_WORKERS, torch.get_num_threads(), len(blocks)))
    cuda = dev.type == "cuda"

    def one(item: tuple[BlockLayout, dict[str, str]]) -> torch.Tensor:
        lay, keys = item
        buf = torch.zeros(lay.total_bytes, dtype=torch.uint8, device=dev)
        stream = torch.cuda.Stream(dev) if cuda else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(dev))  # after the zeroing
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for e in lay.entries:
                src = view(keys[e.name])
                e.view(buf).copy_(src if src.dtype == e.dtype else src.to(e.dtype))
        if stream is not None:
            stream.synchronize()
        return buf

    if n == 1:
        return [one(b) for b in blocks]
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="fill-resident") as pool:
        return list(pool.map(one, blocks))
