"""MP4 encoding beside a rank: a small process pool, so the rank's next forward never waits.

x264 at 480p x 81 frames of noise takes ~12-14 s on one core; inside the rank it held a
GPU for that long. Frames go to the pool as uint8 arrays and the bytes come back through
a callback. Worker processes are spawned (never forked from a process that holds CUDA)
and import only ``service.models.video`` (PyAV and numpy, no torch), so each costs little
memory. The bytes are those ``encode_mp4`` gives in any process (see video.py).

Each encode runs ``X264_THREADS`` x264 threads, so a rank given C CPUs gets about
C // X264_THREADS encoder processes (``pool_size``): a full pool keeps the rank's CPUs
busy without oversubscribing them. The pool size is free to follow the host; the thread
count is not (it is part of the bytes).

The encoders run niced (engine.priority): a launch of the rank's that waits behind x264
leaves the GPU idle, and an encode gets the CPU the rank leaves, which is most of it.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from service.models.video import X264_THREADS, encode_mp4

from .priority import lower_this_thread

log = logging.getLogger("dloserve.encoder")
Done = Callable[[bytes | None, str | None], None]  # (mp4, error): exactly one is set


def _warm() -> int:
    return 0


def pool_size(cpus: float, threads: int = X264_THREADS) -> int:
    """Encoder processes for a rank given ``cpus`` CPUs: whole encodes of ``threads`` each.

    At least one, so a rank given a fraction of a CPU still encodes off its own thread.
    """
    if threads < 1:
        raise ValueError(f"x264 threads must be >= 1, got {threads}")
    if not math.isfinite(cpus) or cpus < 0:
        raise ValueError(f"cpus must be a finite number >= 0, got {cpus}")
    return max(1, int(cpus) // threads)


def rank_cpus() -> float:
    """The CPUs this process is given: a Ray worker's assigned CPUs, within its affinity.

    Ray reserves CPUs without pinning them, so the reservation is the share; outside Ray
    (``dloserve generate``, tests) the affinity mask is (taskset, cgroups' cpusets).
    """
    affinity = float(len(os.sched_getaffinity(0)))
    ray = sys.modules.get("ray")  # never import Ray for this: only a Ray worker has a share
    if ray is not None and ray.is_initialized():
        ctx = ray.get_runtime_context()
        if ctx.worker.mode == ray.WORKER_MODE:
            assigned = ctx.get_assigned_resources().get("CPU")
            if assigned:
                return min(float(assigned), affinity)
    return affinity


class Encoder:
    """``submit(frames, fps, done)``; ``workers=0`` encodes inline on the caller's thread,
    ``None`` sizes the pool from the CPUs this process is given (``pool_size``)."""

    def __init__(self, workers: int | None = None) -> None:
        if workers is None:
            cpus = rank_cpus()
            workers = pool_size(cpus)
            log.info("MP4 encoders: %d processes of %d x264 threads (%g CPUs given)",
                     workers, X264_THREADS, cpus)
        if workers < 0:
            raise ValueError(f"encoder workers must be >= 0, got {workers}")
        self.workers = workers
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None
        self._inflight = 0
        self._warming: list[Future] = []
        if workers:
            self._pool = self._new_pool()
            # Start the processes now (imports take a second): not on the first request. They
            # come up while the rank loads its model; ``wait_warm`` waits for them.
            self._warming = [self._pool.submit(_warm) for _ in range(workers)]

    def wait_warm(self, timeout: float = 120) -> None:
        """Block until every encoder process has started (raises if one could not)."""
        for f in self._warming:
            f.result(timeout=timeout)
        self._warming = []

    def _new_pool(self) -> ProcessPoolExecutor:
        ctx = multiprocessing.get_context("spawn")
        return ProcessPoolExecutor(max_workers=self.workers, mp_context=ctx, initializer=lower_this_thread)

    @property
    def inflight(self) -> int:
        with self._lock:
            return self._inflight

    def submit(self, frames: np.ndarray, fps: int, done: Done) -> None:
        """Encode in the pool (or inline); ``done`` runs once, from some thread, when it ends."""
        if self._pool is None:
            try:
                data = encode_mp4(frames, fps)
            except Exception as e:  # noqa: BLE001 - reported to the request, not raised
                done(None, f"MP4 encoding failed: {e}")
                return
            done(data, None)
            return
        with self._lock:
            self._inflight += 1
            pool = self._pool
        try:
            fut = pool.submit(encode_mp4, frames, fps)
        except (BrokenProcessPool, RuntimeError) as e:
            self._finish(done, None, f"MP4 encoder pool unavailable: {e}")
            self._replace(pool)
            return
        fut.add_done_callback(lambda f: self._collect(f, done, pool))

    def _collect(self, fut: Future, done: Done, pool: ProcessPoolExecutor) -> None:
        try:
            data = fut.result()
        except BrokenProcessPool as e:
            # An encoder process died (killed, or crashed in the codec): new pool, this
            # request fails with the reason, the next ones go to the new processes.
            log.error("MP4 encoder process died: %s", e)
            self._replace(pool)
            self._finish(done, None, f"MP4 encoder process died: {e}")
            return
        except Exception as e:  # noqa: BLE001
            self._finish(done, None, f"MP4 encoding failed: {e}")
            return
        self._finish(done, data, None)

    def _finish(self, done: Done, data: bytes | None, error: str | None) -> None:
        with self._lock:
            self._inflight -= 1
        done(data, error)

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is broken:
                self._pool = self._new_pool()
        broken.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
