"""One rank as a Ray actor: process-group membership, a RankWorker, metrics.

The actor is threaded: ``serve`` holds one thread for as long as the group ticks, while
the driver calls ``assign``, long-polls ``events`` and ``ping``s on the others.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import ray

from service.engine.metrics import metrics, pss_bytes


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank needs to load the same pipeline."""

    model_dir: str
    world: int
    device: str = "cpu"  # "cpu" or "cuda"
    offload: bool = True
    use_allgather: bool = True
    offload_options: dict[str, Any] = field(default_factory=dict, hash=False)  # models.options
    pg_timeout_s: float = 3600.0  # last resort: request deadlines tear the group down first
    group_id: str = "g0"
    rank_offset: int = 0  # this group's first rank among the replica's ranks (metrics tags)
    encoders: int | None = None  # MP4 encoder processes beside the rank (0: inline, None: auto)
    sp_size: int = 1  # > 1: the group's ranks are one SP group (world == sp_size)


def free_port() -> int:
    """An ephemeral port that was free a moment ago (rank 0 binds it right after)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class DPWorker:
    """Rank ``rank`` of a group; see engine.group for the lifecycle."""

    def __init__(self, rank: int, spec: WorkerSpec) -> None:
        self.rank = rank
        self.spec = spec
        self.runner: Any = None
        self.worker: Any = None
        self.pg: Any = None
        self._seen: dict[str, float] = {}
        self._tags = {"group": spec.group_id, "rank": str(spec.rank_offset + rank)}
        self._gauges: dict[str, float] = {}
        self._last_step: dict[str, float] = {}
        # Ray drops a gauge series not re-set within ~2 report intervals: keep ours fresh.
        threading.Thread(target=self._refresh_gauges, name="gauges", daemon=True).start()

    def rendezvous_address(self) -> str:
        """Rank 0 picks its node IP and a free port for the TCP rendezvous."""
        return f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"

    def setup(self, init_method: str) -> dict[str, Any]:
        """Join the process group, load the pipeline, start the rank loop; returns load facts."""
        import torch
        import torch.distributed as dist

        from service.engine.encoder import Encoder
        from service.engine.rank import RankWorker
        from service.models.pipeline import OffloadConfig, PipelineRunner

        t0 = time.monotonic()
        device = self.spec.device
        control = None
        if device == "cuda":
            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this rank's GPU
        if self.spec.world > 1:
            dist.init_process_group(
                "nccl" if device == "cuda" else "gloo",
                init_method=init_method,
                rank=self.rank,
                world_size=self.spec.world,
                timeout=timedelta(seconds=self.spec.pg_timeout_s),
            )
            self.pg = dist.group.WORLD
            control = dist.new_group(backend="gloo")
        offload = OffloadConfig.from_options(self.spec.offload, self.spec.use_allgather,
                                             self.spec.offload_options)
        self.runner = PipelineRunner.load(
            self.spec.model_dir, device=device, offload=offload,
            group=self.pg if self.spec.offload else None, sequence_parallel=self.spec.sp_size,
        )
        sp = self.spec.sp_size > 1
        self.worker = RankWorker(self.runner, self.rank, self.spec.world, control,
                                 Encoder(self.spec.encoders if not sp or self.rank == 0 else 0),
                                 on_report=self._report_offload, sequence_parallel=sp,
                                 lead=not sp or self.rank == 0)  # DP: every rank reports its own
        self._report_memory()
        return {"rank": self.rank, "pid": os.getpid(), "load_s": time.monotonic() - t0,
                "encoders": self.worker.encoder.workers}

    # -- the rank loop, for the driver ---------------------------------------------------

    def assign(self, job_id: str, req: Any) -> None:
        self.worker.assign(job_id, req)

    def serve(self) -> dict[str, Any]:
        return self.worker.serve()

    def events(self, timeout: float = 1.0) -> list[dict[str, Any]]:
        evs = self.worker.events(timeout)
        for e in evs:
            if e["kind"] == "step":
                now = time.monotonic()
                last = self._last_step.get(e["id"])
                if last is not None:
                    metrics()["step_time"].observe(now - last, tags=self._tags)
                self._last_step[e["id"]] = now
            elif e["kind"] == "finished":
                self._last_step.pop(e["id"], None)
        return evs

    def status(self) -> dict[str, Any]:
        return self.worker.status() if self.worker is not None else {"rank": self.rank}

    def ping(self) -> int:
        return os.getpid()

    def info(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": os.getpid(), **self.status()}

    def close(self) -> None:
        import torch.distributed as dist

        if self.worker is not None:
            self.worker.close()
            self.worker = None
        if self.runner is not None:
            self.runner.close()
            self.runner = None
        if self.pg is not None and dist.is_initialized():
            dist.destroy_process_group()
            self.pg = None

    # -- metrics -----------------------------------------------------------------------

    def _report_offload(self) -> None:
        """Turn the runner's cumulative offload stats into counter increments (tick thread)."""
        stats = self.runner.offload_stats(sync=False) if self.runner else None
        if not stats:
            return
        m = metrics()
        for key, metric in (
            ("stall_s", "stall"),
            ("gather_s", "allgather_s"),
            ("gathered_bytes", "allgather_bytes"),
            ("h2d_bytes", "h2d_bytes"),
        ):
            value = float(stats.get(key) or 0.0)
            delta = value - self._seen.get(key, 0.0)
            if delta > 0:
                m[metric].inc(delta, tags=self._tags)
            self._seen[key] = value
        for key, metric in (("host_pinned_bytes", "pinned"), ("device_peak_bytes", "device_peak")):
            if stats.get(key) is not None:
                self._gauges[metric] = float(stats[key])
        self._set_gauges()

    def _report_memory(self) -> None:
        self._gauges["pss"] = float(pss_bytes())
        self._set_gauges()

    def _set_gauges(self) -> None:
        m = metrics()
        for name, value in list(self._gauges.items()):
            m[name].set(value, tags=self._tags)

    def _refresh_gauges(self, every_s: float = 1.0) -> None:
        while True:
            time.sleep(every_s)
            self._report_memory()


DPWorkerActor = ray.remote(max_concurrency=4)(DPWorker)


def probe_mode(model_dir: str, device: str, world: int, options: dict[str, Any]) -> dict[str, Any]:
    """``--dlo-mode auto`` before the groups form: probe on one rank's resources, choose for N.

    One rank cannot time an AllGather, so the choice counts the gather as free (it runs
    on a side stream; 1.4 ms of a 703 MB block on NVLink) and says so in its reason.
    """
    from dataclasses import replace

    import torch

    from service.models.adapter import load_adapter
    from service.models.pipeline import OffloadConfig, probe_transformer
    from service.offload.auto import choose_mode

    if device == "cuda":
        torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this bundle's GPU
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    cfg = OffloadConfig.from_options(True, True, options)
    timings = replace(probe_transformer(load_adapter(model_dir), dev, cfg, None), world=world)
    choice = choose_mode(timings).as_dict()
    if world > 1:
        choice["reason"] += "; AllGather time not measured before the group forms (taken as free)"
    return choice


ProbeTask = ray.remote(max_retries=0)(probe_mode)
