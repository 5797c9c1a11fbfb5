"""One rank as a Ray actor: ``start_rank`` inside an actor, plus the rank's metrics.

The actor is threaded: ``serve`` holds one thread for as long as the group ticks, while
the executor calls ``assign``, ``cancel``, long-polls ``events`` and ``ping``s on the others.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import ray

from service.config import EngineConfig
from service.engine.metrics import metrics, pss_bytes

from .events import Event, EventKind
from .place import RankPlace


class RankActor:
    """Process ``place.rank`` of a group; see engine.ray_executor for the lifecycle."""

    def __init__(self, config: EngineConfig, place: RankPlace) -> None:
        self.config, self.place = config, place
        self.worker: Any = None
        self._seen: dict[str, float] = {}
        self._tags = {"group": place.group_id, "rank": place.label}
        self._gauges: dict[str, float] = {}
        self._last_step: dict[str, float] = {}
        self._stop = threading.Event()
        # Ray drops a gauge series not re-set within ~2 report intervals: keep ours fresh.
        self._gauge_thread = threading.Thread(target=self._refresh_gauges, name="gauges", daemon=True)
        self._gauge_thread.start()

    def started(self) -> dict[str, Any]:
        """Answers once the process has started (its constructor is done)."""
        return {"pid": os.getpid(), "standby": False,
                "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def rendezvous_address(self) -> str:
        """Process 0 picks its node IP and a free port of it for the TCP rendezvous; the
        store listens on that address only (start.rendezvous_store): the loopback one on a
        loopback cluster (``dloserve serve --host 127.0.0.1``)."""
        from .ports import free_port

        ip = ray.util.get_node_ip_address()
        return f"tcp://{f'[{ip}]' if ':' in ip else ip}:{free_port(ip)}"

    def setup(self, init_method: str | None) -> dict[str, Any]:
        """Join the process group, load the pipeline, start the rank loop; returns load facts."""
        import torch

        from .start import load_facts, start_rank

        t0 = time.monotonic()
        # Ray sets CUDA_VISIBLE_DEVICES to this rank's GPU: it is device 0 here.
        device = torch.device("cuda", 0) if self.config.parallel.device == "cuda" else torch.device("cpu")
        self.worker = start_rank(self.config, self.place, init_method, device, on_report=self._report_offload)
        self._report_memory()
        return load_facts(self.worker, t0)

    # -- the rank loop, for the executor -------------------------------------------------

    def assign(self, job_id: str, req: Any) -> str | None:
        """None when queued; else why the rank refused the request, as a plain string: a
        refusal is that request's failure only, and a string crosses the process boundary
        whatever the exception was (one that did not unpickle read as this rank's death)."""
        from .executor import short

        try:
            self.worker.assign(job_id, req)
        except Exception as e:  # noqa: BLE001 - refused: that request only
            return short(e) or type(e).__name__
        return None

    def cancel(self, job_id: str) -> bool:
        return self.worker.cancel(job_id)

    def serve(self) -> dict[str, Any]:
        return self.worker.serve()

    def events(self, timeout: float = 1.0) -> list[Event]:
        evs = self.worker.events(timeout)
        for e in evs:
            # a preview's or a state's STEP is no new step
            if e.kind is EventKind.STEP and e.preview is None and e.state is None:
                now = time.monotonic()
                last = self._last_step.get(e.job_id)
                if last is not None:
                    metrics()["step_time"].observe(now - last, tags=self._tags)
                self._last_step[e.job_id] = now
            elif e.kind is EventKind.FINISHED:
                self._last_step.pop(e.job_id, None)
        return evs

    def status(self) -> dict[str, Any]:
        return self.worker.status() if self.worker is not None else {"rank": self.place.rank}

    def ping(self) -> int:
        return os.getpid()

    def close(self) -> None:
        from .start import stop_rank

        self._stop.set()
        self._gauge_thread.join(timeout=5)
        worker, self.worker = self.worker, None
        stop_rank(worker)

    # -- metrics -----------------------------------------------------------------------

    def _report_offload(self) -> None:
        """Turn the runner's cumulative offload stats into counter increments (tick thread)."""
        stats = self.worker.runner.offload_stats(sync=False) if self.worker else None
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
        while not self._stop.wait(every_s):
            self._report_memory()


RankActorRemote = ray.remote(max_concurrency=5)(RankActor)
