"""The Grafana dashboard as code: writes deploy/grafana-dashboard.json (grafana-foundation-sdk).

    python deploy/dashboard.py            # regenerate; tests/api/test_deploy_files.py checks it is current

Every panel's queries name ray_dloserve_* metrics (service/engine/metrics.py); a live test
(tests/api/test_prometheus.py) evaluates each one against a real Prometheus.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder

OUT = Path(__file__).resolve().parent / "grafana-dashboard.json"
W = 12  # two panels per row

# (title, unit, [(query, legend)])
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Throughput (videos per hour)", "short",
     [('sum(rate(ray_dloserve_requests_total{status="completed"}[5m])) * 3600', "completed/h")]),
    ("Requests by final status (/s)", "reqps",
     [("sum by (status) (rate(ray_dloserve_requests_total[5m]))", "{{status}}")]),
    ("Request latency, accepted to final (p50 / p95 / p99)", "s",
     [(f"histogram_quantile({q}, sum by (le) (rate(ray_dloserve_request_latency_seconds_bucket[5m])))",
       f"p{int(q * 100)}") for q in (0.5, 0.95, 0.99)]),
    ("Queue depth and bound", "short", [("sum by (group) (ray_dloserve_queue_depth)", "depth {{group}}"),
                                        ("max by (group) (ray_dloserve_queue_capacity)", "bound {{group}}")]),
    ("Assignments by scheduler and reason (/s)", "reqps",
     [("sum by (scheduler, reason) (rate(ray_dloserve_assignments_total[5m]))", "{{scheduler}} {{reason}}")]),
    ("Wave size (mean; 1 under continuous scheduling)", "short",
     [("sum(rate(ray_dloserve_wave_size_sum[5m])) / sum(rate(ray_dloserve_wave_size_count[5m]))", "mean")]),
    ("Rank time per request p50 (assignment to end)", "s",
     [("histogram_quantile(0.5, sum by (le) (rate(ray_dloserve_wave_latency_seconds_bucket[5m])))", "p50")]),
    ("Step time p50 per rank", "s",
     [("histogram_quantile(0.5, sum by (le, rank) (rate(ray_dloserve_step_seconds_bucket[5m])))",
       "rank {{rank}}")]),
    ("Weight stall share per rank (s of stall per s)", "percentunit",
     [("sum by (rank) (rate(ray_dloserve_weight_stall_seconds_total[5m]))", "rank {{rank}}")]),
    ("AllGather share per rank (s in gathers per s, overlaps compute)", "percentunit",
     [("sum by (rank) (rate(ray_dloserve_allgather_seconds_total[5m]))", "rank {{rank}}")]),
    ("H2D and gathered bytes per second", "Bps",  # CPU ranks copy nothing to a device: H2D is 0
     [("sum by (rank) (rate(ray_dloserve_h2d_bytes_total[5m])) or on() vector(0)", "H2D rank {{rank}}"),
      ("sum by (rank) (rate(ray_dloserve_allgather_bytes_total[5m]))", "gathered rank {{rank}}")]),
    ("Host memory per rank: PSS and pinned", "bytes",
     [("sum by (rank) (ray_dloserve_pss_bytes)", "PSS rank {{rank}}"),
      ("sum by (rank) (ray_dloserve_host_pinned_bytes)", "pinned rank {{rank}}")]),
    ("Device memory peak per rank", "bytes",
     [("max by (rank) (ray_dloserve_device_peak_bytes)", "rank {{rank}}")]),
    ("Where a request's time goes: seconds per stage (p50)", "s",
     [("histogram_quantile(0.5, sum by (le, stage) (rate(ray_dloserve_stage_seconds_bucket[5m])))",
       "{{stage}}")]),
    ("Slow requests: seconds per stage (p95)", "s",
     [("histogram_quantile(0.95, sum by (le, stage) (rate(ray_dloserve_stage_seconds_bucket[5m])))",
       "{{stage}}")]),
    ("Engine state (1 = in it), group starts by outcome (1 h), results storage (1 = takes writes)", "short",
     [("max by (state) (ray_dloserve_engine_availability)", "{{state}}"),
      ("sum by (outcome) (increase(ray_dloserve_group_start_attempts_total[1h]))", "starts {{outcome}}"),
      ("min by (group) (ray_dloserve_storage_ready)", "storage takes writes {{group}}")]),
    ("Groups ready, rebuilds, requests run again, replicas lost, preemptions and resumes (1 h)", "short",
     [("sum by (group) (ray_dloserve_group_ready)", "ready {{group}}"),
      ("sum by (reason) (increase(ray_dloserve_requests_requeued_total[1h]))", "run again: {{reason}}"),
      ("sum by (group, reason) (increase(ray_dloserve_group_rebuilds_total[1h]))", "rebuilds {{reason}}"),
      ("sum by (node) (increase(ray_dloserve_dp_groups_lost_total[1h]))", "replica lost on {{node}}"),
      # none until a better priority pauses a request: 0, so the live test's query has data
      ("sum by (group) (increase(ray_dloserve_preemptions_total[1h])) or on() vector(0)",
       "paused for a better priority {{group}}"),
      ("sum by (cause) (increase(ray_dloserve_resumes_total[1h])) or on() vector(0)",
       "went on from a kept step: {{cause}}")]),
    ("Webhook delivery failures by reason (1 h; retried until given_up)", "short",
     [("sum by (reason) (increase(ray_dloserve_webhook_failures_total[1h]))", "{{reason}}")]),
]


def build() -> dict:
    d = (dashboard.Dashboard("dloserve").uid("dloserve").tags(["dloserve", "ray"]).refresh("10s")
         .time("now-1h", "now").editable())
    for title, unit, queries in PANELS:
        panel = timeseries.Panel().title(title).unit(unit).height(8).span(W)
        for ref, (expr, legend) in zip("ABCDEFGH", queries, strict=False):
            panel = panel.with_target(prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref))
        d = d.with_panel(panel)
    return json.loads(JSONEncoder(sort_keys=True, indent=2).encode(d.build()))


def render() -> str:
    return json.dumps(build(), indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT} ({len(PANELS)} panels)", file=sys.stderr)
