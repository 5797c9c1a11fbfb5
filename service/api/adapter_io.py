"""Adapter registration's own threads: its file reads never hold up job submission.

``POST /v1/loras`` reads and hashes a whole file under ``--lora-dir``. A read that blocks (a
hung NFS or FUSE mount; a FIFO is refused before it is opened) used to sit in asyncio's
default executor, the one ``POST /v1/videos`` uses too: eight of them stopped every job
submission while ``/healthz`` stayed green. Here registrations get a pool of their own:
``workers`` threads, no queue behind them (a registration that finds them all busy is
refused at once, 503 with Retry-After), and a read timeout (the caller gets 504; a thread
stuck in the kernel stays stuck, but holds only its own slot, and an adapter whose read
ends after its caller gave up is not registered).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from service.api.errors import Answer, ApiError


class AdapterIOBusy(ApiError):
    """Every adapter-reading thread is busy (Retry-After)."""

    answer = Answer(503, "lora_io_busy", type="server_error", param="source")
    retry_after_s = 30


class AdapterIOTimeout(ApiError):
    """The read did not end within the timeout."""

    answer = Answer(504, "lora_read_timeout", type="server_error", param="source")


class AdapterIO:
    """A bounded pool, with a timeout per call, for blocking adapter reads."""

    def __init__(self, workers: int, timeout_s: float) -> None:
        self.workers, self.timeout_s = workers, timeout_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="dloserve-lora-io")
        self._free = threading.Semaphore(workers)

    async def run(self, fn: Callable[..., Any], *args: Any, undo: Callable[[Any], None] | None = None) -> Any:
        """``fn(*args)`` on one of the pool's threads; AdapterIOBusy now if none is free,
        AdapterIOTimeout after ``timeout_s`` (then ``undo(result)`` if it still succeeds)."""
        if not self._free.acquire(blocking=False):
            raise AdapterIOBusy(f"all {self.workers} adapter-reading threads are busy (a slow or hung "
                                f"file under --lora-dir?); retry after {AdapterIOBusy.retry_after_s} s")
        lock = threading.Lock()
        state = {"abandoned": False, "done": False}

        def call() -> Any:
            try:
                result = fn(*args)
                with lock:
                    state["done"] = True
                    if state["abandoned"] and undo is not None:
                        undo(result)
                return result
            finally:
                self._free.release()

        future = asyncio.get_running_loop().run_in_executor(self._pool, call)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except TimeoutError:
            with lock:
                finished = state["done"]
                state["abandoned"] = not finished
            if finished:  # it ended just now: the caller gets it after all
                return await future
            future.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody awaits it now
            raise AdapterIOTimeout(f"reading the adapter took over {self.timeout_s:g} s (a slow or hung "
                                   "file system?); it was not registered") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
