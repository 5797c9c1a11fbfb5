"""A rank actor that imports before it is needed, so a rebuilt rank re-attaches.

Every rank process of the Ray executor is a ``WarmRankActor``: its constructor imports
what loading needs (torch, diffusers and the model's classes, by building the transformer
once on the meta device), so a group's start shows the process start and imports apart
from the load (``actors_s`` and ``actors.import_s`` in ``/readyz``).

Once a group is ready the executor starts one more per rank process, a *standby*, in the
same placement-group bundle with no resources of its own (the rank holds them). It imports
and waits. When a rank dies, the rebuilt group is made of the standbys: no new interpreter
and no imports, only the process group and the load. Ray gives a zero-GPU actor
``CUDA_VISIBLE_DEVICES=""`` and one thread, so a standby is told what the rank it replaces
had (its GPU ids, before anything initialises CUDA; its CPU share for torch's threads; the
encoder pool's size, in its config). Its encoder processes start while it waits, too.
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Any

import ray

from service.config import EngineConfig

from .start import RankPlace, rank_encoder
from .worker import RankActor


def warm_imports(config: EngineConfig) -> float:
    """Import what ``PipelineRunner.load`` imports lazily (diffusers, transformers, the
    model's classes): build the transformer on the meta device and drop it. Seconds taken."""
    from service.models.registry import load_adapter

    t0 = time.monotonic()
    adapter = load_adapter(config.model_dir, sequence_parallel=config.parallel.sp_size)
    adapter.build_transformer()
    for name, entry in adapter.index.items():
        if not name.startswith("_") and isinstance(entry, list) and entry[0]:
            try:
                adapter.component_class(name)
            except Exception:  # noqa: BLE001 - the load names a bad component; this only warms
                pass
    return time.monotonic() - t0


class WarmRankActor(RankActor):
    """A ``RankActor`` that has imported by the time it answers ``started``; ``standby``:
    started ahead, in a bundle whose resources the rank it will replace holds."""

    def __init__(self, config: EngineConfig, place: RankPlace, standby: bool = False,
                 visible_devices: str | None = None) -> None:
        if visible_devices is not None:  # before anything initialises CUDA in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
        super().__init__(config, place)
        self.standby = standby
        if standby:
            import torch

            # What Ray gives a rank of cpus_per_rank CPUs (OMP_NUM_THREADS), not a 0-CPU actor's 1.
            threads = max(1, math.floor(config.parallel.cpus_per_rank))
            os.environ["OMP_NUM_THREADS"] = str(threads)
            torch.set_num_threads(threads)
            # A standby reports no gauges: its group/rank tags are the live rank's.
            self._stop.set()
            self._gauge_thread.join(timeout=5)
        self.created = time.time()
        self.import_s = warm_imports(config)
        # A standby's encoder processes start now too (a new rank's start while it loads).
        self._encoder = rank_encoder(config, place) if standby else None

    def started(self) -> dict[str, Any]:
        """Answers once the constructor (process start and imports) is done."""
        return {"pid": os.getpid(), "import_s": round(self.import_s, 3), "created": self.created,
                "standby": self.standby, "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def setup(self, init_method: str | None) -> dict[str, Any]:
        if self.standby:  # now the rank: its gauges are this process's
            self._stop = threading.Event()
            self._gauge_thread = threading.Thread(target=self._refresh_gauges, name="gauges", daemon=True)
            self._gauge_thread.start()
        encoder, self._encoder = self._encoder, None
        if encoder is None:
            return super().setup(init_method)
        import torch

        from .start import load_facts, start_rank

        t0 = time.monotonic()
        device = torch.device("cuda", 0) if self.config.parallel.device == "cuda" else torch.device("cpu")
        self.worker = start_rank(self.config, self.place, init_method, device, on_report=self._report_offload,
                                 encoder=encoder)
        self._report_memory()
        return load_facts(self.worker, t0)


class StandbyRank(WarmRankActor):
    """A standby, by class name too: Ray titles an actor's process ``ray::NAME:CLASS.method``,
    so tools (and tests) that find rank processes by "RankActor" never take a waiting standby
    for a rank. A rank that was a standby keeps this title."""


WarmRankActorRemote = ray.remote(max_concurrency=5)(WarmRankActor)
StandbyRankRemote = ray.remote(max_concurrency=5)(StandbyRank)
