"""One DP rank as a Ray actor: process-group membership, a PipelineRunner, progress.

The actor is threaded (max_concurrency=2) so the group can poll ``progress`` while ``run``
holds the main thread inside a denoising loop.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
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
    pg_timeout_s: float = 3600.0  # last resort: the wave deadline tears the group down first
    group_id: str = "g0"


def free_port() -> int:
    """An ephemeral port that was free a moment ago (rank 0 binds it right after)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class DPWorker:
    """Rank ``rank`` of a DP group; see DPGroup for the lifecycle."""

    def __init__(self, rank: int, spec: WorkerSpec) -> None:
        self.rank = rank
        self.spec = spec
        self.runner: Any = None
        self.pg: Any = None
        self.calls = 0
        self._progress: dict[str, Any] = {"wave": None, "step": 0, "total": 0}
        self._lock = threading.Lock()
        self._busy = threading.Lock()
        self._seen: dict[str, float] = {}
        self._tags = {"group": spec.group_id, "rank": str(rank)}
        self._gauges: dict[str, float] = {}
        # Ray drops a gauge series not re-set within ~2 report intervals: keep ours fresh.
        threading.Thread(target=self._refresh_gauges, name="gauges", daemon=True).start()

    def rendezvous_address(self) -> str:
        """Rank 0 picks its node IP and a free port for the TCP rendezvous."""
        return f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"

    def setup(self, init_method: str) -> dict[str, Any]:
        """Join the process group and load the pipeline with DLO; returns load facts."""
        import torch
        import torch.distributed as dist

        from service.models.pipeline import OffloadConfig, PipelineRunner

        t0 = time.monotonic()
        device = self.spec.device
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
        offload = OffloadConfig(enabled=self.spec.offload, use_allgather=self.spec.use_allgather)
        self.runner = PipelineRunner.load(
            self.spec.model_dir, device=device, offload=offload, group=self.pg
        )
        self._report_memory()
        return {"rank": self.rank, "pid": os.getpid(), "load_s": time.monotonic() - t0}

    def run(self, wave_id: str, reqs: list[Any]) -> dict[str, Any]:
        """Run ``reqs[rank]``, or idle-replay ``reqs[0]``'s gathers if this rank has none."""
        # The actor is threaded for progress polls; two waves at once would interleave
        # their gathers on one ring, so a second one is refused.
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(f"rank {self.rank} is still running wave {self._progress.get('wave')}")
        try:
            return self._run(wave_id, reqs)
        finally:
            self._busy.release()

    def _run(self, wave_id: str, reqs: list[Any]) -> dict[str, Any]:
        self.calls += 1
        t0 = time.monotonic()
        last = [t0]
        step_hist = metrics()["step_time"]

        def on_step(step: int, total: int) -> None:
            now = time.monotonic()
            step_hist.observe(now - last[0], tags=self._tags)
            last[0] = now
            with self._lock:
                self._progress = {"wave": wave_id, "step": step, "total": total}

        with self._lock:
            self._progress = {"wave": wave_id, "step": 0, "total": 0}
        mp4: bytes | None = None
        if self.rank < len(reqs):
            mp4 = self.runner.generate(reqs[self.rank], on_step=on_step)
        else:
            self.runner.idle(reqs[0])
        stats = self._report_offload()
        self._report_memory()
        return {
            "dp_rank": self.rank,
            "wave": wave_id,
            "mp4": mp4,
            "seconds": time.monotonic() - t0,
            "stats": stats,
        }

    def progress(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._progress)

    def info(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": os.getpid(), "calls": self.calls}

    def close(self) -> None:
        import torch.distributed as dist

        if self.runner is not None:
            self.runner.close()
            self.runner = None
        if self.pg is not None and dist.is_initialized():
            dist.destroy_process_group()
            self.pg = None

    def _report_offload(self) -> dict[str, Any] | None:
        """Turn the runner's cumulative offload stats into counter increments."""
        stats = self.runner.offload_stats() if self.runner else None
        if not stats:
            return stats
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
        return stats

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


DPWorkerActor = ray.remote(max_concurrency=2)(DPWorker)
