"""MP4 encoding beside a rank: encoder processes fed frames as the VAE decodes them.

x264 at 480p x 81 frames of noise takes ~12-14 s on one core; inside the rank it held a
GPU for that long. A clip is a ``Stream``: the rank's pipeline thread ``add``s each chunk
of frames the VAE decodes (Wan decodes latent frame by latent frame: 1 frame, then 4 per
latent frame) and ``close``s it; ``done`` gets the bytes later, from a feeder thread. Each
encoder process has one feeder thread here that takes the next open stream (first come,
first served) and sends it chunk by chunk through a pipe, so x264 works while the GPU
still decodes, and the pipeline thread takes its next request without waiting on x264.
``overlap=False`` gives a stream to a process only once it is closed (the whole clip, as
before issue 49): the benchmark's baseline (loadtest/bench_encode.py).

Memory is bounded: chunks wait here until a process takes them, and once ``max_buffered``
bytes wait, ``add`` blocks until a process took some (``waits`` counts it; a rank holds
a clip's frames in memory either way). Failures end the stream's ``done`` with a reason,
exactly once: an encoder process that died (killed, a codec crash: a new one takes its
place), a codec error, or ``abort`` (a decode error, a cancel).

Worker processes are spawned (never forked from a process that holds CUDA), niced
(engine.priority: a rank's launch that waits behind x264 leaves the GPU idle) and import
only ``service.models.video`` (PyAV and numpy, no torch). The bytes are those
``encode_mp4`` gives for the same frames, however they were split (video.Mp4Writer).

Each encode runs ``X264_THREADS`` x264 threads, so a rank given C CPUs gets about
C // X264_THREADS encoder processes (``pool_size``). The pool size follows the host; the
thread count never does, not even for the last clip when the rest of the pool is idle:
x264 writes its thread count into the stream, and its frame threads change the encode
(docs/service.md, "MP4 encoding").
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import sys
import threading
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection

import numpy as np

from service.models.video import X264_THREADS, Mp4Writer

from .priority import lower_this_thread

log = logging.getLogger("dloserve.encoder")
Done = Callable[[bytes | None, str | None], None]  # (mp4, error): exactly one is set
MAX_BUFFERED = 2 * 2**30  # frames waiting for an encoder process, all streams together


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


def _serve(conn: Connection) -> None:
    """An encoder process: ("open", fps), frame chunks, then ("close",) or ("abort",)."""
    lower_this_thread()
    conn.send(("ready", os.getpid()))
    writer: Mp4Writer | None = None
    fps, error = 0, None
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if isinstance(msg, np.ndarray):
            if error is None:
                try:
                    writer = writer or Mp4Writer(msg.shape[2], msg.shape[1], fps)
                    writer.add(msg)
                except Exception as e:  # noqa: BLE001 - reported at close
                    error = f"MP4 encoding failed: {e}"
            continue
        if msg[0] == "open":
            fps, error = msg[1], None
            continue
        reply: tuple[str, bytes | str | None] = ("aborted", None)
        if msg[0] == "close":
            if error is None and writer is None:
                error = "MP4 encoding failed: frames must hold at least one frame"
            if error is None and writer is not None:
                try:
                    reply = ("ok", writer.close())
                except Exception as e:  # noqa: BLE001
                    error = f"MP4 encoding failed: {e}"
            if error is not None:
                reply = ("error", error)
        if writer is not None:
            writer.abort()  # after close: removes nothing left
        writer = None
        conn.send(reply)


class Stream:
    """One clip on its way to an MP4: ``add`` chunks in order, then ``close`` or ``abort``."""

    def __init__(self, encoder: Encoder, fps: int, done: Done, overlap: bool) -> None:
        self._enc, self.fps, self._done = encoder, fps, done
        self._cv = encoder._cv
        self.chunks: deque[np.ndarray] = deque()
        self.closed = False  # no more chunks
        self.ended = False  # done was called
        self.abort_reason: str | None = None
        self.ready = overlap  # a feeder may take it (else at close)
        self.frames = 0
        self.writer: Mp4Writer | None = None  # workers=0: encoding on the caller's thread

    def add(self, frames: np.ndarray) -> None:
        """Queue uint8 [t, H, W, 3] frames (no wait, unless ``max_buffered`` bytes wait)."""
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"frames must be uint8 [T, H, W, 3], got {frames.dtype} {frames.shape}")
        enc = self._enc
        with self._cv:
            if self.closed or self.ended:
                return  # aborted, or its encoder failed: the rest of the clip is dropped
            if enc._buffered > enc.max_buffered and self.ready:
                enc.waits += 1
                self._cv.wait_for(lambda: enc._buffered <= enc.max_buffered or self.ended or enc._closed)
            self.chunks.append(frames)
            self.frames += len(frames)
            enc._buffered += frames.nbytes
            self._cv.notify_all()
        if enc.workers == 0:
            enc._inline(self)

    def close(self) -> None:
        """No more frames: ``done`` gets the MP4 once the encoder has it."""
        with self._cv:
            self.closed = self.ready = True
            self._cv.notify_all()
        if self._enc.workers == 0:
            self._enc._inline(self)

    def abort(self, reason: str) -> None:
        """Drop the clip: ``done(None, reason)`` now, unless it already ended."""
        with self._cv:
            if self.ended or self.abort_reason is not None:
                return
            self.abort_reason = reason
            self.closed = self.ready = True
            self._cv.notify_all()
            taken = self in self._enc._feeding
            if not taken:  # no feeder holds it: end it here
                self._enc._drop(self)
        if not taken:
            self._end(None, reason)

    def _end(self, data: bytes | None, error: str | None) -> None:
        with self._cv:
            if self.ended:
                return
            self.ended = True
            self._enc._buffered -= sum(c.nbytes for c in self.chunks)
            self.chunks.clear()
            self._enc._inflight -= 1
            self._cv.notify_all()
        if self.writer is not None:
            self.writer.abort()
        self._done(data, error)


class Encoder:
    """``open(fps, done)`` a stream (or ``submit`` a whole clip); ``workers=0`` encodes inline
    on the caller's thread, ``None`` sizes the pool from the CPUs this process is given."""

    def __init__(self, workers: int | None = None, *, overlap: bool = True,
                 max_buffered: int = MAX_BUFFERED) -> None:
        if workers is None:
            cpus = rank_cpus()
            workers = pool_size(cpus)
            log.info("MP4 encoders: %d processes of %d x264 threads (%g CPUs given)",
                     workers, X264_THREADS, cpus)
        if workers < 0:
            raise ValueError(f"encoder workers must be >= 0, got {workers}")
        self.workers, self.overlap, self.max_buffered = workers, overlap, max_buffered
        self.waits = 0  # adds that waited for memory (back-pressure)
        self.died = 0  # encoder processes that died and were replaced
        self._cv = threading.Condition()
        self._queue: deque[Stream] = deque()  # open streams no feeder holds yet
        self._feeding: set[Stream] = set()
        self._buffered = 0
        self._inflight = 0
        self._closed = False
        self._procs: list[multiprocessing.Process | None] = [None] * workers
        self._pids: list[int] = [0] * workers
        self._ready = [threading.Event() for _ in range(workers)]
        self._feeders = [threading.Thread(target=self._feed, args=(i,), name=f"mp4-feeder{i}", daemon=True)
                         for i in range(workers)]
        for t in self._feeders:  # the processes start now (imports take a second), not on a request
            t.start()

    @property
    def inflight(self) -> int:
        """Streams opened and not ended."""
        with self._cv:
            return self._inflight

    def pids(self) -> list[int]:
        """The encoder processes' ids (after ``wait_warm``)."""
        return list(self._pids)

    def wait_warm(self, timeout: float = 120) -> None:
        """Block until every encoder process has started (raises if one could not)."""
        for i, ready in enumerate(self._ready):
            if not ready.wait(timeout):
                raise TimeoutError(f"MP4 encoder process {i} did not start in {timeout:g} s")

    def open(self, fps: int, done: Done) -> Stream:
        """A new clip; ``done`` runs once, from some thread, when it ends."""
        if fps < 1:
            raise ValueError(f"fps must be >= 1, got {fps}")
        with self._cv:
            if self._closed:
                raise RuntimeError("the MP4 encoder is closed")
            stream = Stream(self, fps, done, self.overlap)
            self._inflight += 1
            if self.workers:
                self._queue.append(stream)
                self._cv.notify_all()
        return stream

    def submit(self, frames: np.ndarray, fps: int, done: Done) -> None:
        """Encode a whole clip; ``done`` runs once, from some thread, when it ends."""
        stream = self.open(fps, done)
        try:
            stream.add(frames)
        except ValueError as e:
            stream.abort(f"MP4 encoding failed: {e}")
            return
        stream.close()

    def _inline(self, stream: Stream) -> None:
        """workers=0: encode on the caller's thread, chunk by chunk."""
        with self._cv:
            chunks = list(stream.chunks)
            stream.chunks.clear()
            self._buffered -= sum(c.nbytes for c in chunks)
        try:
            for c in chunks:
                stream.writer = stream.writer or Mp4Writer(c.shape[2], c.shape[1], stream.fps)
                stream.writer.add(c)
            if stream.closed and not stream.ended:
                if stream.writer is None:
                    raise ValueError("frames must hold at least one frame")
                data = stream.writer.close()
                stream._end(data, None)
        except Exception as e:  # noqa: BLE001 - reported to the request, not raised
            stream._end(None, f"MP4 encoding failed: {e}")

    def _drop(self, stream: Stream) -> None:
        if stream in self._queue:
            self._queue.remove(stream)

    # -- feeders: one thread per encoder process -------------------------------------

    def _spawn(self, i: int) -> Connection:
        ctx = multiprocessing.get_context("spawn")
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(there,), name=f"mp4-encoder{i}", daemon=True)
        proc.start()
        there.close()
        self._procs[i] = proc
        return here

    def _feed(self, i: int) -> None:
        conn, broken = None, ""
        while True:
            if conn is None:
                try:
                    conn = self._spawn(i)
                    self._pids[i] = conn.recv()[1]
                    broken = ""
                    self._ready[i].set()
                except Exception as e:  # noqa: BLE001 - the next clip fails with it, never waits on it
                    log.error("MP4 encoder process %d did not start: %s", i, e)
                    conn, broken = None, f"MP4 encoder process could not start: {type(e).__name__}: {e}"
            with self._cv:
                self._cv.wait_for(lambda: self._closed or any(s.ready for s in self._queue),
                                  timeout=1.0 if broken else None)
                if self._closed:
                    break
                stream = next((s for s in self._queue if s.ready), None)
                if stream is None:
                    continue
                self._queue.remove(stream)
                self._feeding.add(stream)
            if conn is None:
                data, error = None, broken
            else:
                try:
                    data, error = self._encode(conn, stream)
                except (OSError, EOFError) as e:  # the process died: the clip fails, a new one starts
                    code = self._exit_code(i)
                    log.error("MP4 encoder process %d died (exit code %s): %s", i, code, e)
                    self.died += 1
                    data, error = None, f"MP4 encoder process died (exit code {code})"
                    conn.close()
                    conn = None
            with self._cv:
                self._feeding.discard(stream)
            stream._end(data, stream.abort_reason or error)
        if conn is not None:
            conn.close()
        proc = self._procs[i]
        if proc is not None:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()

    def _exit_code(self, i: int) -> int | None:
        proc = self._procs[i]
        if proc is None:
            return None
        proc.join(timeout=5)
        return proc.exitcode

    def _encode(self, conn: Connection, stream: Stream) -> tuple[bytes | None, str | None]:
        """Send ``stream`` to the process chunk by chunk as they come; its bytes or error."""
        conn.send(("open", stream.fps))
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(stream.chunks) or stream.closed or self._closed)
                chunk = stream.chunks.popleft() if stream.chunks else None
                if chunk is not None:
                    self._buffered -= chunk.nbytes  # (the one in hand is over the bound)
                    self._cv.notify_all()
                last = chunk is None and stream.closed
                # close() lets a whole clip finish; one still decoding cannot
                aborted = stream.abort_reason is not None or (self._closed and not stream.closed)
            if aborted:
                conn.send(("abort",))
                conn.recv()
                return None, "the MP4 encoder was closed"
            if chunk is not None:
                conn.send(chunk)
            elif last:
                conn.send(("close",))
                kind, payload = conn.recv()
                return (payload, None) if kind == "ok" else (None, payload)

    def close(self) -> None:
        """Stop the processes; streams not ended end with an error."""
        with self._cv:
            self._closed = True
            left = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        for s in left:
            s._end(None, "the MP4 encoder was closed")
        for t in self._feeders:
            t.join(timeout=30)
