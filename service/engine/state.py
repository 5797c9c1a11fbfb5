"""Handing a request's per-step state off the rank, off the group's critical path.

After each denoising step of a resumable request (models/resume.py) the rank hands its
latents to the driver on the STEP event, so that a rerun after the rank's death goes on from
there. The pipeline thread calls ``take`` between two forwards, and the tick thread waits
for it there (the next forward decides what this rank has next), so ``take`` must be short:

- latents on the CPU: one copy (``StepState.of``), emitted at once: 14 ms median for the
  8 MB of a 480p x 81 float32 latent on the loaded 2-core test VM, mostly first-touch page
  faults (loadtest/results/cpu-state-cost-2026-12-02.json), against CPU steps of minutes;
- latents on a GPU: the copy to pinned host memory is queued on a side stream after the
  step's work, and a thread of the tap waits for it and emits; the pipeline thread only
  queues it. The source is kept alive for the side stream (``record_stream``). (Not yet
  run on a GPU: no measurement of it is claimed.)

The dispatcher keeps the last state of each job it holds (router/dispatcher.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from service.models.resume import StepState

Emit = Callable[[StepState], None]
log = logging.getLogger("dloserve.engine")


class StateTap:
    """Copies latents to host memory and calls ``emit`` with the state once it is there."""

    def __init__(self) -> None:
        self.taken = 0  # states handed off
        self.take_s = 0.0  # time the caller of ``take`` spent in it (the pipeline thread's cost)
        self._stream: torch.cuda.Stream | None = None
        self._pending: queue.SimpleQueue[tuple[torch.cuda.Event, int, int, torch.Tensor, Emit] | None] = \
            queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def take(self, step: int, total: int, latents: torch.Tensor, emit: Emit) -> None:
        """Hand ``latents`` (after ``step`` of ``total``) to ``emit`` as a ``StepState``.
        Never raises: a state that cannot be kept costs a rerun its head start, not the request."""
        t0 = time.perf_counter()
        try:
            if latents.device.type == "cuda":
                self._take_cuda(step, total, latents, emit)
            else:
                emit(StepState.of(step, total, latents))
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

    def _take_cuda(self, step: int, total: int, latents: torch.Tensor, emit: Emit) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream(latents.device)
            self._thread = threading.Thread(target=self._drain, name="state-tap", daemon=True)
            self._thread.start()
        src = latents.detach()
        host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(src.device))  # after the step's work
        with torch.cuda.stream(self._stream):
            host.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        src.record_stream(self._stream)  # not reused by the allocator before the copy ran
        self._pending.put((done, step, total, host, emit))

    def _drain(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            done, step, total, host, emit = item
            done.synchronize()
            emit(StepState.wrap(step, total, host))
