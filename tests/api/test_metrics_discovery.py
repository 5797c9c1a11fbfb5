"""Prometheus's list of Ray's metrics endpoints, written by the launcher without Ray's
dashboard: the dashboard's file format, at the path deploy/prometheus/prometheus.yml reads."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from service.api.metrics_discovery import write_service_discovery


def test_the_file_names_the_nodes_metrics_port_and_is_linked_from_the_temp_folder(
        ray_cluster: dict, tmp_path: Path) -> None:
    session, temp = tmp_path / "session", tmp_path / "ray"
    session.mkdir()
    temp.mkdir()
    target = write_service_discovery(str(session), str(temp))
    legacy = temp / "prom_metrics_service_discovery.json"
    assert legacy.is_symlink() and legacy.resolve() == target.resolve()
    (entry,) = json.loads(legacy.read_text())
    assert entry["labels"] == {"job": "ray"}
    node = entry["targets"][0]
    assert node.endswith(f":{ray_cluster['metrics_port']}"), entry
    assert "ray_" in httpx.get(f"http://{node}/metrics", timeout=30).text  # Prometheus can scrape it
    write_service_discovery(str(session), str(temp))  # again (a restart): replaced, not refused
    assert json.loads(legacy.read_text()) == [entry]
