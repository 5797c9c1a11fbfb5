"""Scrape Ray's per-node metrics endpoint over HTTP and parse the dloserve_* families."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import wait_final

# Ray exports application metrics with a "ray_" prefix. dloserve_h2d_bytes and
# dloserve_device_peak_bytes only move on CUDA (on CPU there is no host-to-device copy),
# and Ray omits a counter that was never incremented, so they are not required here.
WANT = {
    "ray_dloserve_requests": "counter",
    "ray_dloserve_queue_depth": "gauge",
    "ray_dloserve_wave_size": "histogram",
    "ray_dloserve_wave_latency_seconds": "histogram",
    "ray_dloserve_step_seconds": "histogram",
    "ray_dloserve_weight_stall_seconds": "counter",
    "ray_dloserve_allgather_bytes": "counter",
    "ray_dloserve_host_pinned_bytes": "gauge",
    "ray_dloserve_pss_bytes": "gauge",
    "ray_dloserve_group_ready": "gauge",
}


def scrape(ray_cluster: dict) -> dict:
    url = f"http://{ray_cluster['node_ip']}:{ray_cluster['metrics_port']}/metrics"
    text = httpx.get(url, timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text) if "dloserve" in f.name}


def samples(fam, suffix: str = "", **labels: str) -> list:  # noqa: ANN001
    return [
        s for s in fam.samples
        if s.name.endswith(suffix) and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def test_dloserve_metrics_are_scraped(app_url: str, ray_cluster: dict) -> None:
    vid = httpx.post(f"{app_url}/v1/videos", json={"prompt": "metrics", "seed": 3}).json()["id"]
    assert wait_final(app_url, vid)["status"] == "completed"
    end = time.monotonic() + 30
    fams: dict = {}
    while time.monotonic() < end:
        fams = scrape(ray_cluster)
        if all(n in fams for n in WANT) and samples(fams["ray_dloserve_requests"], status="completed"):
            break
        time.sleep(1)
    missing = sorted(set(WANT) - set(fams))
    assert not missing, f"missing {missing}; have {sorted(fams)}"
    for name, kind in WANT.items():
        assert fams[name].type == kind, (name, fams[name].type)
    completed = samples(fams["ray_dloserve_requests"], "_total", status="completed")
    assert sum(s.value for s in completed) >= 1
    sizes = samples(fams["ray_dloserve_wave_size"], "_count")
    assert sum(s.value for s in sizes) >= 1
    for rank in ("0", "1"):  # both ranks report, including the idle one
        pss = samples(fams["ray_dloserve_pss_bytes"], rank=rank)
        assert pss and max(s.value for s in pss) > 10e6, (rank, pss)
        assert samples(fams["ray_dloserve_host_pinned_bytes"], rank=rank)  # 0 on CPU: no pinning
        assert sum(s.value for s in samples(fams["ray_dloserve_allgather_bytes"], rank=rank)) > 0
