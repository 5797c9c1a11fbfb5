"""The GPUs Ray gives a rank in a bundle, as a function whose module imports nothing else:
the executor reads them with a small task in the bundle, and Ray imports a task function's
module in the worker that runs it (the executor's own module would pull in torch and the
model code, seconds of a fresh worker's time on the start's critical path)."""

from __future__ import annotations

import os


def visible_devices() -> str:
    """``CUDA_VISIBLE_DEVICES`` as Ray set it for this task."""
    return os.environ.get("CUDA_VISIBLE_DEVICES", "")
