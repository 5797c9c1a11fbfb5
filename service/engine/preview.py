"""A rank's previews: the latents at each step's end, as a small image, on the STEP event path.

The pipeline thread (between two forwards, so on the group's critical path) does only the
projection of one latent frame (models.preview: a [C, h, w] x [C, 3] product) and, on CUDA,
records an event after it; the previewer's own thread waits for that event, copies the few
KB to the host on a side stream, encodes the image and emits a STEP event carrying it. One
slot, latest wins: a step whose image is not encoded before the next one's arrives is
skipped, so the previews of a job come at most once per step and never queue up.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from service.models import preview as images

from .events import Event, EventKind

log = logging.getLogger("dloserve.engine")


class Previewer:
    """Owns one thread; ``take`` is called by the pipeline thread at each step's end."""

    def __init__(self, emit: Callable[[Event], None], rank: int = 0) -> None:
        self.emit, self.rank = emit, rank
        self._cv = threading.Condition()
        self._slot: tuple[str, int, int, torch.Tensor, Any] | None = None
        self._closed = False
        self._busy = False  # the thread is encoding one
        self.made = 0  # previews emitted (tests, stats)
        self._stream: Any = None
        self._thread = threading.Thread(target=self._loop, name=f"rank{rank}-preview", daemon=True)
        self._thread.start()

    def take(self, job_id: str, step: int, total: int, latents: torch.Tensor, height: int,
             width: int) -> None:
        """Project ``latents`` (device work, a few microseconds) and hand it to the thread."""
        try:
            rgb = images.project(images.latent_frame(latents.detach(), height, width))
        except Exception as e:  # noqa: BLE001 - a preview never fails a request
            log.debug("no preview for %s: %s", job_id, e)
            return
        ready = None
        if rgb.is_cuda:
            ready = torch.cuda.Event()
            ready.record()  # on the pipeline's stream: the projection is queued before it
        with self._cv:
            self._slot = (job_id, step, total, rgb, ready)
            self._cv.notify_all()

    def drain(self, timeout_s: float = 1.0) -> None:
        """Wait (after the last step, off the tick path) until the last preview is emitted, so
        it reaches the dispatcher before the job's FINISHED event."""
        with self._cv:
            self._cv.wait_for(lambda: self._slot is None and not self._busy, timeout=timeout_s)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._slot is not None or self._closed)
                if self._closed:
                    return
                assert self._slot is not None
                (job_id, step, total, rgb, ready), self._slot = self._slot, None
                self._busy = True
            try:
                data = images.encode(self._to_host(rgb, ready))
                self.made += 1
                self.emit(Event(EventKind.STEP, rank=self.rank, job_id=job_id, step=step, total=total,
                                preview=data))
            except Exception as e:  # noqa: BLE001 - a preview never fails a request
                log.debug("preview of %s step %d failed: %s", job_id, step, e)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _to_host(self, rgb: torch.Tensor, ready: Any) -> Any:
        if ready is None:
            return rgb.numpy()
        ready.synchronize()  # this thread waits; the pipeline's stream does not
        if self._stream is None:
            self._stream = torch.cuda.Stream(rgb.device)
        with torch.cuda.stream(self._stream):
            return rgb.to("cpu").numpy()
