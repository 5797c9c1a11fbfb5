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

*Pre-started* ranks (``prestart``): ``dloserve serve`` on a cluster of its own starts one
``PrestartRankActor`` per rank process right after ``ray.init``, before Serve, so the rank
processes start and import while the Serve controller, the proxy and the ingress replica
come up (22 + 4.5 s on an H200, one after another before the ranks' own 24 s). They hold no
resources (the placement group does not exist yet); the executor adopts them for its first
groups (``adopt``: the final config, with auto resolved, the place, and the GPUs of the
bundle the rank would have had) and starts new processes only for one that is gone.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import replace
from typing import Any

import ray

from service.config import EngineConfig

from .place import RankPlace, rank_encoder, rank_encoder_count
from .preload import Preload, preloadable
from .priority import run_lowered
from .warmhost import WarmHosts, gpu_per_process, hosted, warm_model_imports
from .worker import RankActor


def warm_imports(config: EngineConfig) -> float:
    """Import what ``PipelineRunner.load`` imports lazily (diffusers, transformers, the
    model's classes): build the transformer on the meta device and drop it. Seconds taken."""
    t0 = time.monotonic()
    warm_model_imports(config.model_dir, config.parallel.sp_size)
    return time.monotonic() - t0


class WarmRankActor(RankActor):
    """A ``RankActor`` that has imported by the time it answers ``started``; ``standby``:
    started ahead, in a bundle whose resources the rank it will replace holds; ``preload``:
    it loads the pipeline while it waits, too (engine.preload)."""

    shares_gpu = True  # a standby's GPU is the live rank's: it keeps room for it (engine.preload)

    def __init__(self, config: EngineConfig, place: RankPlace, standby: bool = False,
                 visible_devices: str | None = None, preload: bool = False) -> None:
        self._devices = visible_devices
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
        host = hosted()  # a warm host's worker: it started and imported before Ray was up
        self.created = host["started"] if host else time.time()
        self.hosted = host is not None
        self.host_cuda_loaded = bool(host and host.get("cuda_loaded"))  # its GPU view is the host's
        self.adopted = False
        beside = standby and self.shares_gpu  # a standby of a serving rank (not a pre-started one)
        # It imports at background priority (engine.priority), as it loads ahead (engine.preload).
        imports = (run_lowered(lambda: warm_imports(config), "standby-imports") if beside
                   else warm_imports(config))
        self.import_s = imports + (host["import_s"] if host else 0.0)
        # A standby's encoder processes start now too (a new rank's start while it loads).
        self._encoder = rank_encoder(config, place) if standby else None
        self.imported_at = time.time()
        self._preload = Preload(config, standby=self.shares_gpu) if preload and standby else None

    def started(self) -> dict[str, Any]:
        """Answers once the constructor (process start and imports) is done."""
        return {"pid": os.getpid(), "import_s": round(self.import_s, 3), "created": self.created,
                "imported_at": self.imported_at, "standby": self.standby, "hosted": self.hosted,
                "host_cuda_loaded": self.host_cuda_loaded,
                "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def adopt(self, config: EngineConfig, place: RankPlace, visible_devices: str | None) -> dict[str, Any]:
        """A pre-started process becomes process ``place`` of a group: the executor's config
        (auto resolved), and the GPUs of the bundle it stands in (set before anything
        initialises CUDA here: nothing has). Its encoder pool is resized if the place's differs.
        Once only: the launcher owns these processes, so one outlives a replica that crashed
        after adopting it; the next replica's executor is refused here and stops it (its GPU
        memory with it) instead of loading a second pipeline into it."""
        if self.adopted:
            raise RuntimeError(f"already adopted as rank {self.place.label} of group {self.place.group_id}")
        gpu = self._devices
        if self._preload is not None and config.parallel.device == "cuda" and visible_devices != gpu:
            raise RuntimeError(f"loading ahead on GPU {gpu!r}, but the bundle has {visible_devices!r}")
        self.adopted = True
        if visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
        self.config, self.place = config, place
        self._tags = {"group": place.group_id, "rank": place.label}
        want = rank_encoder_count(config, place)
        if self._encoder is None or self._encoder.workers != want:
            if self._encoder is not None:
                self._encoder.close()
            self._encoder = rank_encoder(config, place)
        return self.started()

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
        preload, self._preload = self._preload, None
        ahead = preload.take(self.config) if preload is not None else None
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
        super().close()


class StandbyRank(WarmRankActor):
    """A standby, by class name too: Ray titles an actor's process ``ray::NAME:CLASS.method``,
    so tools (and tests) that find rank processes by "RankActor" never take a waiting standby
    for a rank. A rank that was a standby keeps this title."""


WarmRankActorRemote = ray.remote(max_concurrency=5)(WarmRankActor)
class PrestartRankActor(WarmRankActor):
    """A rank process started before the placement group exists (``prestart``); once adopted
    it is a rank of the first generation (its title has "RankActor", as a rank's does)."""

    shares_gpu = False  # it is the rank: the GPU is its own


StandbyRankRemote = ray.remote(max_concurrency=5)(StandbyRank)
PrestartRemote = ray.remote(max_concurrency=5)(PrestartRankActor)


def prestart(config: EngineConfig, instance: str, namespace: str,
             hosts: WarmHosts | None = None) -> dict[str, Any]:
    """One pre-imported rank process per bundle of ``config``, started now with no resources:
    name -> handle, in bundle order. The caller owns them and must keep the handles (Ray ends
    an actor whose handles are all gone, named or not); they end with the caller. With
    ``hosts``, process i's worker runs in warm host i (engine.warmhost), imported already."""
    out: dict[str, Any] = {}
    sp = config.parallel.sp_size
    ahead = preloadable(config) and config.parallel.gpus_per_rank in (0, 1)
    gpus = prestart_gpus(config, os.environ.get("CUDA_VISIBLE_DEVICES")) if ahead else []
    for i in range(config.parallel.processes):
        place = RankPlace("prestart", i % sp, sp, i - i % sp)
        name = f"dloserve-{instance}-prestart{i}"
        par = replace(config.parallel, encoders_per_rank=rank_encoder_count(config, place))
        devices = gpus[i] if i < len(gpus) else None
        host = hosts.executable(i) if hosts is not None else None
        env = {"runtime_env": {"py_executable": host}} if host else {}
        out[name] = PrestartRemote.options(name=name, namespace=namespace, num_cpus=0, num_gpus=0,
                                           max_restarts=0, **env).remote(replace(config, parallel=par), place,
                                                                         True, devices, ahead)
    return out


def prestart_gpus(config: EngineConfig, visible: str | None) -> list[str]:
    """The GPU each pre-started process loads ahead on, before any bundle exists: process i
    takes the node's i-th GPU as Ray names it (the launcher's ``CUDA_VISIBLE_DEVICES``, which
    Ray's ids are, else 0..N-1); the executor adopts each for the bundle Ray gave that GPU.
    None (an empty list) for CPU ranks or a fraction of a GPU per rank: no one GPU to name."""
    if config.parallel.gpus_per_rank != 1:
        return []
    return gpu_per_process(config.parallel.processes, visible)
