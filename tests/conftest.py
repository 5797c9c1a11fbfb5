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
    """ray.init once; yields the GCS address and the node's metrics endpoint.

    Ray gives its raylet a fixed 30 s to register with the GCS; on a machine whose cores
    are busy with other work it can miss that once. A second start is tried before every
    Ray test of the session is failed for it."""
    import ray

    for attempt in (1, 2):
        try:
            ray.init(
                address="local",  # a cluster of our own, never one another process started here
                num_cpus=2,
                include_dashboard=False,
                log_to_driver=False,
                _system_config={"metrics_report_interval_ms": 1000},
            )
            break
        except Exception as e:  # noqa: BLE001 - "The current node timed out during startup"
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
            ray.shutdown()
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
    """A free port below the kernel's ephemeral range (32768+) and above Ray's worker ports
    (10002-19999): a port the kernel handed us could be handed next to one of the Ray
    processes a test starts after picking it (its agents bind port 0), and then the
    service under test cannot bind it."""
    import random

    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict]:
    """An S3-protocol endpoint on 127.0.0.1 (moto's server: there is no AWS here) with a
    bucket; yields the fsspec options every process needs to reach it."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    creds = {"aws_access_key_id": "dloserve", "aws_secret_access_key": "dloserve"}
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **creds)
    s3.create_bucket(Bucket="results")
    yield {"bucket": "results", "storage_options": {
        "endpoint_url": endpoint, "key": creds["aws_access_key_id"], "secret": creds["aws_secret_access_key"],
        "client_kwargs": {"region_name": "us-east-1"}}}
    server.stop()


@pytest.fixture(scope="session")
def demo_model() -> str:
    from service.models.demo import ensure_demo_model

    return str(ensure_demo_model())


@pytest.fixture(scope="session")
def resident(demo_model: str):  # noqa: ANN201 - PipelineRunner
    """The demo model fully resident in the test process: the reference outputs."""
    from service.models.pipeline import PipelineRunner

    runner = PipelineRunner.load(demo_model, "cpu", config=None)
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def euler_model(demo_model: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The demo model with a flow-matching Euler scheduler (shift 3.0), the one a rerun can
    resume (models/resume.py); the other components are the demo model's own files."""
    from service.models.demo.euler import euler_view

    return str(euler_view(demo_model, tmp_path_factory.mktemp("euler") / "model"))
