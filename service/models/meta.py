"""Building modules without storage (the meta device), safely from any thread."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_EMPTY_WEIGHTS = threading.Lock()


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """accelerate's ``init_empty_weights``, one thread at a time: it swaps
    ``nn.Module.register_parameter`` for the whole process, so two threads inside it at once
    can leave the swap in place for good (every later module then builds on meta)."""
    from accelerate import init_empty_weights

    with _EMPTY_WEIGHTS, init_empty_weights():
        yield
