"""The dloserve_* metrics, recorded with ray.util.metrics.

Every process (ingress replica, worker rank, batch driver) records into Ray's per-node
metrics agent, so Prometheus scrapes one endpoint per node and sees all replicas and
ranks. Ray exports them with a ``ray_`` prefix: ``dloserve_wave_size`` is scraped as
``ray_dloserve_wave_size``. Objects are created lazily, once per process, after ray.init.
"""

from __future__ import annotations

import functools
from typing import Any

_SECONDS = [0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800]
_STEP = [0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
_RANK = ("group", "rank")


@functools.cache
def metrics() -> dict[str, Any]:
    """All metric objects by short name (created on first use in this process; Ray is
    imported here, not at module import, so the dispatcher's module imports no Ray)."""
    from ray.util.metrics import Counter, Gauge, Histogram

    return {
        "requests": Counter(
            "dloserve_requests_total", "Requests by final status", tag_keys=("status",)
        ),
        "request_latency": Histogram(
            "dloserve_request_latency_seconds", "Accepted to final status, per request (the client's wait)",
            _SECONDS, ("status",)
        ),
        "assignments": Counter(
            "dloserve_assignments_total", "Requests handed to a rank, by scheduler and why it left the queue",
            ("scheduler", "reason"),
        ),
        "queue_depth": Gauge("dloserve_queue_depth", "Requests waiting for a rank", ("group",)),
        "queue_capacity": Gauge("dloserve_queue_capacity", "Bound of the queue (429 beyond it)", ("group",)),
        "wave_size": Histogram(
            "dloserve_wave_size", "Requests per wave (1 per assignment under continuous scheduling)",
            [1, 2, 3, 4, 6, 8, 16], ("group",)
        ),
        "wave_latency": Histogram(
            "dloserve_wave_latency_seconds", "Wall time from a rank taking a request to its end",
            _SECONDS, ("group", "outcome")
        ),
        "stage": Histogram(
            "dloserve_stage_seconds", "Seconds per stage of a finished request (queue, text_encode, denoise, "
            "decode, encode, store)", _SECONDS, ("stage",)
        ),
        "rebuild_attempts": Counter(
            "dloserve_group_start_attempts_total", "Starts and rebuilds of rank groups, by outcome",
            ("outcome",)
        ),
        "availability": Gauge(
            "dloserve_engine_availability", "1 for the state the engine is in (serving, recovering, down)",
            ("state",)
        ),
        "step_time": Histogram(
            "dloserve_step_seconds", "Denoising step wall time per rank", _STEP, _RANK
        ),
        "stall": Counter(
            "dloserve_weight_stall_seconds_total",
            "Time compute waited for block weights (CPU: host wait; CUDA: compute-stream gap)",
            _RANK,
        ),
        "allgather_s": Counter(
            "dloserve_allgather_seconds_total", "Time spent in weight AllGathers", _RANK
        ),
        "allgather_bytes": Counter(
            "dloserve_allgather_bytes_total", "Bytes rebuilt by AllGather", _RANK
        ),
        "h2d_bytes": Counter("dloserve_h2d_bytes_total", "Host-to-device weight bytes", _RANK),
        "pinned": Gauge("dloserve_host_pinned_bytes", "Host pinned weight bytes per rank", _RANK),
        "pss": Gauge("dloserve_pss_bytes", "Proportional set size per rank process", _RANK),
        "device_peak": Gauge("dloserve_device_peak_bytes", "Device memory peak per rank", _RANK),
        "rebuilds": Counter(
            "dloserve_group_rebuilds_total", "DP group teardown+rebuilds", ("group", "reason")
        ),
        "requeued": Counter(
            "dloserve_requests_requeued_total", "Requests queued again: their rank group died under them",
            ("reason",)
        ),
        "preemptions": Counter(
            "dloserve_preemptions_total", "Running requests paused at a step for a better-priority one "
            "(each goes on later from its step)", ("group",)
        ),
        "resumes": Counter(
            "dloserve_resumes_total", "Requests that went on from a kept step instead of step 0, by why they "
            "stopped (preempted; rerun: their rank group died; adopted: a lost replica's or a restart's)",
            ("group", "cause")
        ),
        "group_ready": Gauge("dloserve_group_ready", "1 when the DP group serves", ("group",)),
        "storage_ready": Gauge(
            "dloserve_storage_ready", "1 while the results storage takes this replica's writes, 0 after one "
            "was refused (full, read-only) until a probe write succeeds", ("group",)
        ),
        "groups_lost": Counter(
            "dloserve_dp_groups_lost_total", "Replicas (DP groups) that stopped heartbeating with jobs held",
            ("node",)
        ),
        "webhook_failures": Counter(
            "dloserve_webhook_failures_total", "Webhook delivery attempts that failed (each retry counts), "
            "events dropped on a full queue and deliveries given up", ("reason", "type")
        ),
    }


def log_to_stderr() -> None:
    """dloserve's INFO lines (auto's choice, each group's start-up breakdown) on stderr of this
    process: a Ray worker's stderr reaches the driver's output, Python's default drops INFO."""
    import logging
    import sys

    logger = logging.getLogger("dloserve")
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    if not any(getattr(h, "_dloserve", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        handler._dloserve = True  # type: ignore[attr-defined]
        logger.addHandler(handler)


def pss_bytes(pid: str = "self") -> int:
    """PSS from smaps_rollup: shared mmap pages count 1/N per mapping process."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
