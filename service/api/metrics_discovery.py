"""Prometheus's list of Ray's metrics endpoints, where Ray's dashboard would write it.

Ray's dashboard writes ``prom_metrics_service_discovery.json`` (Prometheus file-based
service discovery) in the session folder, linked from Ray's temp folder, and
``deploy/prometheus/prometheus.yml`` reads it there. ``dloserve serve`` starts its own
cluster without the dashboard (it delays Ray's start by seconds), so it writes the same
file itself: one node, its metrics export port, and the autoscaler's when it has one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import ray

from service.api.ray_hooks import autoscaler_metrics_address, session_dirs

PROMETHEUS_SERVICE_DISCOVERY_FILE = "prom_metrics_service_discovery.json"  # the dashboard's name for it


def write_service_discovery(session_dir: str | None = None, temp_dir: str | None = None) -> Path:
    """Write the file (atomically) and its link from ``temp_dir``; the folders default to this
    driver's Ray session's. Returns the file's path."""
    if session_dir and temp_dir:
        session, temp = Path(session_dir), Path(temp_dir)
    else:
        session, temp = session_dirs()
    targets = [f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}" for n in ray.nodes() if n.get("Alive")]
    autoscaler = autoscaler_metrics_address()
    if autoscaler:
        targets.append(autoscaler)
    target = session / PROMETHEUS_SERVICE_DISCOVERY_FILE
    tmp = session / f"tmp_{PROMETHEUS_SERVICE_DISCOVERY_FILE}"
    tmp.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": targets}]))
    os.replace(tmp, target)
    if temp != session:  # the path Prometheus configs name: a link to this session's file
        legacy = temp / PROMETHEUS_SERVICE_DISCOVERY_FILE
        legacy.unlink(missing_ok=True)
        legacy.symlink_to(target)
    return target
