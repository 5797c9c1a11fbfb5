"""Shared fixtures: one real local Ray cluster per test session (2 CPUs, no dashboard).

Metrics are reported every second (instead of Ray's default 10 s) so the scrape test
does not sleep. Tests that need Ray ask for ``ray_cluster``; pure tests never start it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[dict]:
    """ray.init once; yields the GCS address and the node's metrics endpoint."""
    import ray

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    node = ray.nodes()[0]
    yield {
        "address": ray.get_runtime_context().gcs_address,
        "node_ip": node["NodeManagerAddress"],
        "metrics_port": node["MetricsExportPort"],
    }
    try:
        from ray import serve

        serve.shutdown()
    finally:
        ray.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def demo_model() -> str:
    from service.models.demo import ensure_demo_model

    return str(ensure_demo_model())


@pytest.fixture(scope="session")
def resident(demo_model: str):  # noqa: ANN201 - PipelineRunner
    """The demo model fully resident in the test process: the reference outputs."""
    from service.models.pipeline import OffloadConfig, PipelineRunner

    runner = PipelineRunner.load(demo_model, "cpu", offload=OffloadConfig(enabled=False))
    yield runner
    runner.close()
