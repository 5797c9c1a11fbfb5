"""Handing a request's per-step state off the rank, off the group's critical path.

After each denoising step of a resumable request (models/resume.py) the rank hands its
latents and the loop's state (models/loop.py: a multistep scheduler's history, a step cache's
residuals) to the driver on the STEP event, so that a rerun after the rank's death goes on from
there. The pipeline thread calls ``take`` between two forwards, and the tick thread waits
for it there (the next forward decides what this rank has next), so ``take`` must be short:

- on the CPU: one copy (``StepState.of``), emitted at once: 14 ms median for the 8 MB of
  a 480p x 81 float32 latent on the loaded 2-core test VM, mostly first-touch page faults
  (loadtest/results/cpu-state-cost-2026-12-02.json), against CPU steps of minutes;
- on a GPU: the copies of the device tensors to pinned host memory are queued on a side
  stream after the step's work, and a thread of the tap waits for them and emits; the
  pipeline thread only queues them (the loop's CPU tensors, a few kB, it copies itself).
  The sources are kept alive for the side stream (``record_stream``). (Not yet run on a
  GPU: no measurement of it is claimed.)

The dispatcher keeps the last state of each job it holds (router/dispatcher.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from service.models.resume import Blob, StepState, encode_loop

Emit = Callable[[StepState], None]
log = logging.getLogger("dloserve.engine")


class StateTap:
    """Copies latents to host memory and calls ``emit`` with the state once it is there."""

    def __init__(self) -> None:
        self.taken = 0  # states handed off
        self.take_s = 0.0  # time the caller of ``take`` spent in it (the pipeline thread's cost)
        self._stream: torch.cuda.Stream | None = None
        self._pending: queue.SimpleQueue[tuple[torch.cuda.Event, Any, Emit] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def take(self, step: int, total: int, latents: torch.Tensor, loop: dict[str, Any] | None,
             emit: Emit) -> None:
        """Hand ``latents`` and ``loop`` (after ``step`` of ``total``) to ``emit`` as a
        ``StepState``. Never raises: a state that cannot be kept costs a rerun its head start,
        not the request."""
        t0 = time.perf_counter()
        try:
            if latents.device.type == "cuda":
                self._take_cuda(step, total, latents, loop, emit)
            else:
                emit(StepState.of(step, total, latents, loop))
        except Exception:  # noqa: BLE001 - the state is a head start, never the request's failure
            log.exception("step %d's state was not kept", step)
            return
        self.taken += 1
        self.take_s += time.perf_counter() - t0

    def close(self) -> None:
        if self._thread is not None:
            self._pending.put(None)
            self._thread.join(timeout=5)
            self._thread = None

    def _take_cuda(self, step: int, total: int, latents: torch.Tensor, loop: dict[str, Any] | None,
                   emit: Emit) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream(latents.device)
            self._thread = threading.Thread(target=self._drain, name="state-tap", daemon=True)
            self._thread.start()
        skeleton, values = encode_loop(loop)
        self._stream.wait_stream(torch.cuda.current_stream(latents.device))  # after the step's work
        copies: list[Any] = []  # (host tensor, it was on the CPU) or a Blob already made
        with torch.cuda.stream(self._stream):
            for v in [latents, *values]:
                if not isinstance(v, torch.Tensor) or v.device.type == "cpu":
                    copies.append(Blob.of(v))
                    continue
                src = v.detach()
                host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                host.copy_(src.contiguous(), non_blocking=True)
                src.record_stream(self._stream)  # not reused by the allocator before the copy ran
                copies.append(host)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._pending.put((done, (step, total, skeleton, copies), emit))

    def _drain(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            done, (step, total, skeleton, copies), emit = item
            done.synchronize()
            blobs = [c if isinstance(c, Blob) else Blob.wrap(c, False) for c in copies]
            emit(StepState.wrap(step, total, copies[0], skeleton, tuple(blobs[1:])))
