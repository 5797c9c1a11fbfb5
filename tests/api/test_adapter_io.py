"""Adapter registration's own threads: a read that hangs never holds up job submission.

The hung read is real: a FIFO nobody writes to, opened the ordinary (blocking) way. The
readers are set free at the end by opening the FIFO for writing and closing it.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from pathlib import Path

import pytest

from service.api.adapter_io import AdapterIO, AdapterIOBusy, AdapterIOTimeout


def release(fifo: Path) -> None:
    """Wake every reader blocked on ``fifo``: a writer comes and goes (EOF)."""
    for _ in range(200):
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno == errno.ENXIO:  # no reader left
                return
            raise
        os.close(fd)
        threading.Event().wait(0.02)


def test_a_hung_read_times_out_holds_only_its_own_threads_and_is_undone(tmp_path: Path) -> None:
    fifo = tmp_path / "hung.safetensors"
    os.mkfifo(fifo)
    io = AdapterIO(workers=2, timeout_s=0.5)
    undone: list[bytes] = []

    def read() -> bytes:
        with open(fifo, "rb") as f:  # blocks until a writer comes: a hung mount's read
            return f.read()

    async def scenario() -> None:
        stuck = [asyncio.ensure_future(io.run(read, undo=undone.append)) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(AdapterIOBusy, match="all 2 adapter-reading threads are busy"):
            await io.run(read)  # refused at once: no queue behind stuck threads
        assert await asyncio.to_thread(lambda: "free") == "free"  # the default executor is not theirs
        for t in stuck:
            with pytest.raises(AdapterIOTimeout, match="was not registered"):
                await t

    try:
        asyncio.run(scenario())
    finally:
        release(fifo)
    io.close()
    io._pool.shutdown(wait=True)
    assert undone == [b"", b""]  # the reads ended after their callers gave up: undone
