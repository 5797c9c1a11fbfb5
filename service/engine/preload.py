"""A standby loads its rank's pipeline ahead, so it takes over without the load.

A standby of a *one-process* group (DP1, or the ranks of rank-local and resident mode)
needs no process group to load: it loads on a thread while it waits (the checkpoint, the
components, the compile warm-up), and its group's ``setup`` only starts the rank loop. A
group of several processes (an AllGather group, an SP group) shards over its process group
and so loads after it forms. A standby shares its GPU with the live rank: it keeps its load
only while at least ``STANDBY_FREE_SHARE`` of the GPU stays free (the live rank's requests
need the rest), else drops it and loads when it takes over.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING

from service.config import EngineConfig

from .priority import lower_this_thread

if TYPE_CHECKING:
    from .start import Preloaded

log = logging.getLogger("dloserve.engine")
STANDBY_FREE_SHARE = 0.25  # of the GPU's memory, left free after a standby's load


def preloadable(config: EngineConfig) -> bool:
    """Whether ``config``'s groups are of one process (their ranks can load before a group
    forms): no sequence parallelism, and one group or no gather between the ranks (an auto
    mode that a DP>1 engine resolves later could still make one AllGather group)."""
    from service.config import OffloadMode

    if not config.parallel.rank_standby_preload or config.parallel.sp_size > 1:
        return False
    single = (OffloadMode.RANK_LOCAL, OffloadMode.RESIDENT)
    return config.parallel.dp_size == 1 or config.offload.mode in single


class Preload:
    """``start.preload`` on a thread of a standby, kept only where the GPU keeps room for the
    live rank."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.result: Preloaded | None = None
        self.problem: str | None = None  # why nothing is kept (logged; the load runs at setup)
        self.nice: int | None = None  # the loading thread's niceness, once it runs
        self._thread = threading.Thread(target=self._run, name="preload", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import torch

        from .start import preload

        lower_this_thread()  # beside a serving rank: its CPU work below the rank's (engine.priority)
        self.nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        try:
            cuda = self.config.parallel.device == "cuda"
            device = torch.device("cuda", 0) if cuda else torch.device("cpu")
            got = preload(self.config, device)
            room = _room_problem(device)
            if room is not None:
                _drop(got)
                self.problem = room
                return
            self.result = got
        except Exception as e:  # noqa: BLE001 - the load at setup says it properly
            self.problem = f"the load ahead failed ({type(e).__name__}: {e}); it runs at set-up"

    def wait(self) -> bool:
        """Whether the load ahead is done and kept (waits for it)."""
        self._thread.join()
        return self.result is not None

    def take(self) -> Preloaded | None:
        """The load (waits for it to finish); None: load at set-up."""
        self._thread.join()
        got, self.result = self.result, None
        if got is None:
            log.info("standby: nothing loaded ahead to use: %s", self.problem)
        return got

    def close(self) -> None:
        """Free what was loaded and not taken."""
        self._thread.join()
        got, self.result = self.result, None
        if got is not None:
            _drop(got)


def _room_problem(device: object) -> str | None:
    import torch

    if getattr(device, "type", "cpu") != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)  # type: ignore[arg-type]
    if free >= STANDBY_FREE_SHARE * total:
        return None
    return (f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free after the standby's load, under "
            f"{STANDBY_FREE_SHARE:.0%}: dropped (the live rank's requests need it); it loads when it "
            "takes over")


def _drop(got: Preloaded) -> None:
    import torch

    got.runner.close()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
