"""One Serve app (DP=2 AllGather, continuous scheduling, demo model) shared by the HTTP tests."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import free_port

# On a GPU machine: DLOSERVE_TEST_GPUS=1 puts every rank on its own GPU (NCCL).
GPUS_PER_RANK = float(os.environ.get("DLOSERVE_TEST_GPUS", "0"))

QUEUE_SIZE = 6


@pytest.fixture(scope="session")
def app_url(ray_cluster: dict, demo_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from ray import serve

    from service.api.app import deploy
    from service.api.service import ServiceConfig

    cfg = ServiceConfig(
        model=demo_model,
        dp_size=2,
        cpus_per_rank=0.5,
        gpus_per_rank=GPUS_PER_RANK,
        queue_size=QUEUE_SIZE,
        results_dir=str(tmp_path_factory.mktemp("results")),
        pg_timeout_s=60,
        deadline={"base_s": 60, "per_forward_s": 1.0},
    )
    port = free_port()
    t0 = time.monotonic()
    deploy(cfg, "127.0.0.1", port, name="dloserve-test")
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, 180)
    print(f"\ntime to ready: {time.monotonic() - t0:.1f}s")
    yield url
    serve.delete("dloserve-test")


def wait_ready(url: str, timeout: float) -> dict:
    end = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < end:
        try:
            r = httpx.get(f"{url}/readyz", timeout=5)
            last = r.json()
            if r.status_code == 200:
                return last
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.25)
    raise AssertionError(f"not ready after {timeout}s: {last}")


def wait_final(url: str, vid: str, timeout: float = 120, headers: dict | None = None) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = httpx.get(f"{url}/v1/videos/{vid}", timeout=10, headers=headers).json()
        if v["status"] in ("completed", "failed"):
            return v
        time.sleep(0.1)
    raise AssertionError(f"{vid} not final after {timeout}s: {v}")
