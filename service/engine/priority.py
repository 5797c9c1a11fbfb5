"""A rank process's background work below the CPU priority of its serving threads.

The threads that serve (the tick thread, the pipeline thread) launch the GPU work: one that
waits for a CPU leaves the GPU idle. Work beside them that is not on that path (the MP4
encoders, a standby's imports and load ahead) runs niced, ``BACKGROUND_NICE`` above them.
On Linux niceness is per thread and a thread (or process) inherits its starter's, so the
work is lowered where it starts and what it starts follows. Raising niceness needs no
privilege; lowering it does, which is why a standby lowers its loader threads, never the
process that becomes the rank.

Measured on one H200 (16 cores, 12 Wan-14B-shaped layers, 24 short clips sent at once,
loadtest/results/h200-serve-short24-2026-12-03-*.json): encoders niced 0.829 of the resident
ideal against 0.805 not niced, one run each.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger("dloserve.engine")
BACKGROUND_NICE = 10
T = TypeVar("T")


def lower_this_thread(by: int = BACKGROUND_NICE) -> bool:
    """Raise the calling thread's niceness by ``by`` (the kernel caps it at 19); False where
    the platform cannot (the work then runs at the caller's priority)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + by)
        return True
    except (OSError, AttributeError) as e:
        log.warning("could not lower a background thread's CPU priority: %s", e)
        return False


def run_lowered(fn: Callable[[], T], name: str) -> T:
    """``fn()`` on a thread of its own at background priority, waited for: its result, or
    its exception raised here."""
    out: dict[str, object] = {}

    def body() -> None:
        lower_this_thread()
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            out["error"] = e

    t = threading.Thread(target=body, name=name, daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["result"]  # type: ignore[return-value]
