"""A live Prometheus (Debian's package) scrapes a running dloserve through deploy/prometheus/:
every query of the Grafana dashboard answers with data, and the alert rules load.

The service runs DP2 AllGather on its own Ray cluster (metrics reported every second);
the traffic includes completed jobs, a 422, 429s from a tiny queue, and a killed rank (so
the rebuild counter exists). The scrape config is deploy/prometheus/prometheus.yml with two
things changed for a test: the discovery file's folder (this cluster's RAY_TMPDIR) and the
intervals (1 s).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from service.api.hostproc import matching
from tests.api.conftest import Serve, wait_final
from tests.conftest import free_port

pytestmark = pytest.mark.deploy
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def query(prom: str, expr: str) -> list:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert r["status"] == "success", (expr, r)
    return r["data"]["result"]


def test_every_dashboard_query_returns_data(ray_tmp: Path, tmp_path: Path, demo_model: str) -> None:
    prometheus = shutil.which("prometheus")
    assert prometheus, "prometheus missing: make setup installs Debian's prometheus package"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # A webhook receiver that is not there (a free port nobody listens on): its delivery
    # failures are the webhook panel's data.
    secret = tmp_path / "webhook.secret"
    secret.write_text("whsec_" + base64.b64encode(os.urandom(32)).decode())
    s = Serve(ray_tmp, demo_model, "--port", str(port), "--data-parallel-size", "2",  # tiny: fast steps
              "--enable-distributed-layerwise-offload", "--dlo-mode", "allgather",  # auto: rank-local here
              "--cpus-per-rank", "0.5", "--queue-size", "2",
              "--webhook-url", f"http://127.0.0.1:{free_port()}/hook", "--webhook-secret-file", str(secret),
              "--webhook-allow-private",  # a loopback receiver: connect refused, not the address
              "--results-dir", str(tmp_path / "results"), "--group-timeout-s", "3",
              env={"RAY_metrics_report_interval_ms": "1000"})
    s.watch_until(lambda: "dloserve ready at" in s.output, timeout=300)

    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    cfg["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    cfg["rule_files"] = [str(DEPLOY / "prometheus" / "alerts.yml")]
    cfg["scrape_configs"][0]["file_sd_configs"][0]["files"] = [
        str(ray_tmp / "ray" / "prom_metrics_service_discovery.json")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    pport = free_port()
    prom = f"http://127.0.0.1:{pport}"
    pcmd = [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{pport}"]
    pproc = subprocess.Popen(pcmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Traffic: jobs that complete, one 422, a burst into a queue of 2 (429s), then a killed rank.
        assert httpx.post(f"{url}/v1/videos", json={"prompt": "x", "width": 33}).status_code == 422
        with ThreadPoolExecutor(8) as pool:
            rs = list(pool.map(lambda i: httpx.post(f"{url}/v1/videos", json={"prompt": f"p{i}", "seed": i},
                                                    timeout=30), range(8)))
        assert {r.status_code for r in rs} == {202, 429}, [r.status_code for r in rs]
        for r in rs:
            if r.status_code == 202:
                assert wait_final(url, r.json()["id"])["status"] == "completed"
        # A rank killed while it holds a job: the job runs again on the rebuilt group.
        body = {"prompt": "run twice", "num_inference_steps": 40}
        rerun = httpx.post(f"{url}/v1/videos", json=body).json()["id"]
        while (st := httpx.get(f"{url}/v1/videos/{rerun}").json()["status"]) != "in_progress":
            assert st == "queued", st
            time.sleep(0.05)
        rank = matching(s.proc.pid, "RankActor")[0]
        os.kill(rank, signal.SIGKILL)
        end = time.monotonic() + 120
        while (ready := httpx.get(f"{url}/readyz")).status_code != 200 or ready.json()["rebuilds"] < 1:
            assert time.monotonic() < end, ready.text
            time.sleep(0.5)
        done = wait_final(url, rerun, timeout=300)  # on a failure: the job's reason and the log
        assert done["status"] == "completed", json.dumps(done.get("error")) + "\n" + s.output[-6000:]
        vid = httpx.post(f"{url}/v1/videos", json={"prompt": "after the rebuild"}).json()["id"]
        assert wait_final(url, vid)["status"] == "completed"
        # ... and the replica killed while it holds a job: the job store notices the lost group
        # and Serve's new replica runs the job again
        doomed = {"prompt": "doomed", "num_inference_steps": 100}
        vid = httpx.post(f"{url}/v1/videos", json=doomed).json()["id"]
        while (st := httpx.get(f"{url}/v1/videos/{vid}").json()["status"]) != "in_progress":
            assert st == "queued", st  # 100 steps take long enough to be caught running
            time.sleep(0.05)
        for pid in matching(s.proc.pid, "ServeReplica:dloserve"):
            os.kill(pid, signal.SIGKILL)
        lost = wait_final(url, vid, timeout=400)
        assert lost["status"] == "completed", json.dumps(lost.get("error")) + "\n" + s.output[-6000:]
        end = time.monotonic() + 180  # Serve's new replica serves (and its ranks report again)
        while (r := httpx.post(f"{url}/v1/videos", json={"prompt": "after the replica"})).status_code != 202:
            assert time.monotonic() < end, r.text
            time.sleep(0.5)
        assert wait_final(url, r.json()["id"], timeout=180)["status"] == "completed"

        dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
        exprs = [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]
        empty = exprs
        end = time.monotonic() + 90
        while empty and time.monotonic() < end:
            empty = [(title, e) for title, e in exprs if not query(prom, e)]
            time.sleep(2)
        assert not empty, empty
        print(f"\n{len(exprs)} dashboard queries, all answered with data")
        rules = httpx.get(f"{prom}/api/v1/rules").json()["data"]["groups"]
        ours = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
        assert sum(len(g["rules"]) for g in rules) == sum(len(g["rules"]) for g in ours) and all(
            r["health"] == "ok" for g in rules for r in g["rules"]), rules
    finally:
        pproc.send_signal(signal.SIGTERM)
        pproc.wait(30)
        s.stop(signal.SIGTERM)
    assert not s.survivors()
