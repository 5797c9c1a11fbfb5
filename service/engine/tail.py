"""A request's tail on its rank: decoded frames to an MP4 encoder stream, and one end.

The pipeline thread ``add``s each chunk the VAE decodes (engine.encoder streams it to an
encoder process while the decode goes on) and calls ``end`` when its part is over; the
encoder's callback comes from a feeder thread whenever x264 is done. ``finish`` runs once,
after both: so a request's FINISHED never comes before its rank left the tail, and never
twice. An error or cancel on the pipeline thread aborts the stream and wins over whatever
the encoder says; an encoder failure mid-decode (a killed process) wins over the frames
that were still coming.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from .encoder import Encoder, Stream

# (mp4, error, cancelled): exactly one of mp4 and error is set
Finish = Callable[[bytes | None, str | None, bool], None]


class Handoff:
    """The frames of one request on their way to its MP4."""

    def __init__(self, encoder: Encoder, fps: int, finish: Finish) -> None:
        self._encoder, self._fps, self._finish = encoder, fps, finish
        self._lock = threading.Lock()
        self._stream: Stream | None = None
        self._encoded: tuple[bytes | None, str | None] | None = None
        self._ended = False  # the pipeline thread's part is over
        self._finished = False
        self.frames = 0

    def add(self, frames: np.ndarray) -> None:
        """Pipeline thread: the next decoded frames (the stream opens on the first)."""
        if self._stream is None:
            self._stream = self._encoder.open(self._fps, self._on_encoded)
        self._stream.add(frames)
        self.frames += len(frames)

    def end(self, error: str | None = None, cancelled: bool = False) -> None:
        """Pipeline thread: all frames are in (``error`` None), or the request failed."""
        stream = self._stream
        if error is None and stream is None:
            error = "the pipeline gave no frames"
        if error is not None:
            with self._lock:
                self._ended = True
                done, self._finished = self._finished, True
            if stream is not None:
                stream.abort(error)  # its callback comes back here and is dropped
            if not done:
                self._finish(None, error, cancelled)
            return
        assert stream is not None
        stream.close()
        self._settle(ended=True)

    def cancel(self) -> bool:
        """Any thread, once the pipeline thread is done: drop the encode, end ``cancelled``.
        False if the MP4 is already there."""
        with self._lock:
            if self._finished or self._encoded is not None:
                return False
            self._finished = True
        if self._stream is not None:
            self._stream.abort("cancelled")
        self._finish(None, "cancelled", True)
        return True

    def _on_encoded(self, data: bytes | None, error: str | None) -> None:
        with self._lock:
            self._encoded = (data, error)
        self._settle(ended=False)

    def _settle(self, ended: bool) -> None:
        with self._lock:
            self._ended = self._ended or ended
            if self._finished or not self._ended or self._encoded is None:
                return
            self._finished = True
            data, error = self._encoded
        self._finish(data, error, False)

    @property
    def finished(self) -> bool:
        with self._lock:
            return self._finished
