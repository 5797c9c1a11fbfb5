"""What `dloserve serve --host 127.0.0.1` exposes, seen from outside its process tree.

Every TCP listener of the service's processes, Ray's own included (GCS, raylet, agents,
workers, and the metrics export port, which answers without the cluster's token), is on
a loopback address, but one: Ray 2.60 binds the Serve replica's gRPC server (calls between
deployments) to [::]:0 whatever the node's address, and that one must refuse a caller
without the cluster's token. /readyz without a key says ready or not (and the launcher,
which reads its ``instance``, still recognised its own service: it printed "ready").

The same start is test_launch_lifecycle.py's stale-cluster and "SIGINT while serving" case
(one `dloserve serve` start instead of two): a ``ray_current_cluster`` naming a dead cluster
is not joined (the service starts its own), and SIGINT once serving exits 0 with every
process it started gone.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import grpc
import httpx
import pytest

from service.api.hostproc import descendants, listeners
from tests.api.conftest import Serve
from tests.conftest import free_port


@pytest.mark.e2e  # a `dloserve serve` subprocess and its own Ray cluster
def test_a_loopback_host_keeps_every_ray_listener_on_loopback(ray_tmp: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-exposure-0123456789 max_queued=2\n")
    port = free_port()
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}")  # nobody there
    s = Serve(ray_tmp, "--host", "127.0.0.1", "--port", str(port), "--api-key-file", str(keys),
              "--results-dir", str(tmp_path / "results"), env={"HF_HUB_OFFLINE": "0"})
    s.watch_until(lambda: "dloserve ready at" in s.output, timeout=300)
    s.seen |= set(descendants(s.proc.pid))
    assert "Connecting to existing Ray cluster" not in s.output  # the stale address was not joined
    assert len(s.seen) >= 5  # GCS, raylet, agents, Serve controller, proxy, replica, rank
    # Without --ray-dashboard Ray runs only its minimal dashboard process (no web server, no
    # module processes); the workers get HF_HUB_OFFLINE=1 from the launcher's environment (no
    # runtime_env), whatever the caller's was.
    dashboards = [_cmdline(p) for p in s.seen if "ray/dashboard/dashboard.py" in _cmdline(p)]
    assert dashboards and all("--disable-frontend" in c for c in dashboards), dashboards
    replicas = [p for p in s.seen if _cmdline(p).startswith("ray::ServeReplica")]
    assert replicas and all(_environ(p).get("HF_HUB_OFFLINE") == "1" for p in replicas), replicas
    controllers = [p for p in s.seen if _cmdline(p).startswith("ray::ServeController")]
    assert controllers and _environ(controllers[0]).get("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S") == "30"
    found = listeners([s.proc.pid, *s.seen])
    assert len(found) >= 5, found  # the HTTP proxy, GCS, raylet, agents, workers
    wide = [x for x in found if not x["loopback"]]
    assert all(str(x["process"]).startswith("ray::ServeReplica") for x in wide), wide
    for x in wide:  # reachable from anywhere, so it must want the token
        channel = grpc.insecure_channel(f"127.0.0.1:{x['port']}")
        call = channel.unary_unary("/ray.serve.ASGIService/HandleRequest")
        try:
            call(b"", timeout=30)
            raise AssertionError(f"{x} answered a call without the cluster's token")
        except grpc.RpcError as e:
            assert e.code() is grpc.StatusCode.UNAUTHENTICATED, (x, e.code(), e.details())
    assert "these still listen beyond loopback" not in s.output  # nothing else: no warning
    # Ray's metrics export port, as Ray advertises it to Prometheus (the node's comes first;
    # the autoscaler's and dashboard's fixed ports follow, held by whichever cluster on this
    # machine took them first): one of our listeners, on loopback, and it is the real one.
    discovery = next(ray_tmp.rglob("prom_metrics_service_discovery.json"))
    targets = [t for entry in json.loads(discovery.read_text()) for t in entry["targets"]]
    host, _, mport = targets[0].rpartition(":")
    loopback_ports = {int(x["port"]) for x in found if x["loopback"]}
    assert host == "127.0.0.1" and int(mport) in loopback_ports, (targets, found)
    assert "ray_" in httpx.get(f"http://{targets[0]}/metrics", timeout=30).text
    ready = httpx.get(f"http://127.0.0.1:{port}/readyz")
    assert ready.status_code == 200 and set(ready.json()) == {"ready", "instance"}
    # SIGINT while serving (SIGTERM while serving: test_launch_lifecycle.py's drain tests)
    assert s.stop(signal.SIGINT) == 0, s.output[-2000:]
    assert not s.survivors(), s.survivors()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _environ(pid: int) -> dict[str, str]:
    """The environment a process was started with."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode(errors="replace").split("=", 1) for x in raw if b"=" in x)
