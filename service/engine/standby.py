"""A standby: one more process per rank that has imported (and, where it can, loaded) ahead.

Once a group is ready the executor starts one ``StandbyRank`` per rank process, in the same
placement-group bundle with no resources of its own (the rank holds them; Ray's GPU and CPU
accounting is the rank's). It imports what loading needs (torch, diffusers and the model's
classes, by building the transformer on the meta device), starts its MP4 encoder processes,
and in a one-process group loads the pipeline too (engine.preload). When a rank dies, the
rebuilt group is made of its standbys: no new interpreter, no imports and, loaded ahead, no
load. Ray gives a zero-GPU actor ``CUDA_VISIBLE_DEVICES=""`` and one thread, so a standby is
told what the rank it replaces has: its GPU ids (before anything initialises CUDA), its CPU
share for torch's threads and the encoder pool's size (in its config). Its imports and load
run at background priority beside the serving rank (engine.priority).
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Any

import ray

from service.config import EngineConfig

from .place import RankPlace, rank_encoder
from .preload import Preload
from .priority import run_lowered
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


class StandbyRank(RankActor):
    """A rank process waiting to replace rank ``place``; ``preload``: it loads the pipeline
    while it waits. Its class name is in its process title (``ray::NAME:StandbyRank.method``),
    so tools that find rank processes by "RankActor" never take a waiting standby for a rank."""

    def __init__(self, config: EngineConfig, place: RankPlace, visible_devices: str | None,
                 preload: bool = False) -> None:
        if visible_devices is not None:  # before anything initialises CUDA in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
        super().__init__(config, place)
        import torch

        # What Ray gives a rank of cpus_per_rank CPUs (OMP_NUM_THREADS), not a 0-CPU actor's 1.
        threads = max(1, math.floor(config.parallel.cpus_per_rank))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
        self._stop.set()  # a standby reports no gauges: its group/rank tags are the live rank's
        self._gauge_thread.join(timeout=5)
        self.import_s = run_lowered(lambda: warm_imports(config), "standby-imports")
        self._encoder = rank_encoder(config, place)  # a new rank's start while it loads, done now
        self._preload = Preload(config) if preload else None

    def started(self) -> dict[str, Any]:
        return {**super().started(), "standby": True, "import_s": round(self.import_s, 3)}

    def setup(self, init_method: str | None) -> dict[str, Any]:
        import torch

        from .start import load_facts, start_rank

        self._stop = threading.Event()  # now the rank: its gauges are this process's
        self._gauge_thread = threading.Thread(target=self._refresh_gauges, name="gauges", daemon=True)
        self._gauge_thread.start()
        t0 = time.monotonic()
        encoder, self._encoder = self._encoder, None
        preload, self._preload = self._preload, None
        ahead = preload.take() if preload is not None else None
        device = torch.device("cuda", 0) if self.config.parallel.device == "cuda" else torch.device("cpu")
        self.worker = start_rank(self.config, self.place, init_method, device, on_report=self._report_offload,
                                 encoder=encoder, preloaded=ahead)
        self._report_memory()
        return load_facts(self.worker, t0)

    def ahead(self) -> bool:
        """Whether it has loaded ahead and kept it (waits for the load ahead to end)."""
        preload = self._preload
        return preload is not None and preload.wait()

    def close(self) -> None:
        preload, self._preload = self._preload, None
        if preload is not None:
            preload.close()
        encoder, self._encoder = self._encoder, None
        if encoder is not None:
            encoder.close()
        super().close()


StandbyRankRemote = ray.remote(max_concurrency=5)(StandbyRank)
