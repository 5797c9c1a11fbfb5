"""Prometheus's list of Ray's metrics endpoints, where Ray's dashboard would write it.

Ray's dashboard writes ``prom_metrics_service_discovery.json`` (Prometheus file-based
service discovery) in the session folder, linked from Ray's temp folder, and
``deploy/prometheus/prometheus.yml`` reads it there. ``dloserve serve`` starts its own
cluster without the dashboard (it delays Ray's start by seconds), so it writes the same
file itself: every live node's metrics export port (``ray.nodes()``), in the session folder
``ray.init`` named (its ``address_info``), linked from the temp folder above it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import ray

PROMETHEUS_SERVICE_DISCOVERY_FILE = "prom_metrics_service_discovery.json"  # the dashboard's name for it


def write_service_discovery(session_dir: str, temp_dir: str | None = None) -> Path:
    """Write the file (atomically) in ``session_dir`` and its link from ``temp_dir`` (default:
    the folder Ray keeps its sessions in, the session folder's parent). Returns its path."""
    session = Path(session_dir)
    temp = Path(temp_dir) if temp_dir else session.parent
    targets = [f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}" for n in ray.nodes() if n.get("Alive")]
    target = session / PROMETHEUS_SERVICE_DISCOVERY_FILE
    tmp = session / f"tmp_{PROMETHEUS_SERVICE_DISCOVERY_FILE}"
    tmp.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": targets}]))
    os.replace(tmp, target)
    if temp != session:  # the path Prometheus configs name: a link to this session's file
        legacy = temp / PROMETHEUS_SERVICE_DISCOVERY_FILE
        legacy.unlink(missing_ok=True)
        legacy.symlink_to(target)
    return target
