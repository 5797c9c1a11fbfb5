"""`dloserve serve` start-up and stop, as a user meets them, in real subprocesses.

- A port another instance listens on ends a second one at once, exit code 2, naming the
  port and the process that holds it (the first instance's Serve proxy).
- A stale ``ray_current_cluster`` (a dead cluster's address) is not joined: the service
  starts a cluster of its own (with SIGINT while serving: test_exposure.py, whose start it
  shares). An explicit dead ``--address`` fails fast, naming it.
- An app whose replica cannot start ends the start with exit code 2 and the replica's error.
- SIGINT and SIGTERM at several moments of start-up and while serving stop the service,
  and every process it started (raylet, GCS, ``ray::`` workers) is gone afterwards.
Each run gets its own Ray temp folder, so nothing here touches the test session's cluster.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from service.api.hostproc import descendants, kill_tree, matching
from tests.api.conftest import Serve, wait_ready
from tests.conftest import free_port

pytestmark = pytest.mark.e2e  # each test starts `dloserve serve` (its own Ray cluster) in a subprocess


def test_busy_port_ends_a_second_instance_with_exit_2(app_url: str, ray_tmp: Path) -> None:
    port = app_url.rsplit(":", 1)[1]
    s = Serve(ray_tmp, "--port", port)
    assert s.proc.wait(120) == 2, s.output[-2000:]
    assert f"port {port} on 127.0.0.1 is already in use by pid" in s.output
    assert "ProxyActor" in s.output  # the first instance's Serve proxy holds it
    assert not s.survivors() and not list(ray_tmp.glob("ray/session_*"))  # no cluster was started


def test_a_folder_that_is_no_model_ends_the_start_with_exit_2_and_its_cluster(ray_tmp: Path,
                                                                              tmp_path: Path) -> None:
    """The model's check runs beside Ray's start: a folder that exists but holds no model is
    refused once Ray is up (exit code 2, naming what is missing), and the cluster goes; a
    folder that does not exist is refused before anything starts."""
    s = Serve(ray_tmp, str(tmp_path), "--port", str(free_port()))
    end = time.monotonic() + 240  # a bound on the wait, not a measurement
    while s.proc.poll() is None and time.monotonic() < end:
        s.seen |= set(descendants(s.proc.pid))  # Ray's processes, while they live
        time.sleep(0.05)
    assert s.proc.wait(10) == 2, s.output[-2000:]
    assert "model_index.json" in s.output, s.output[-2000:]
    time.sleep(0.5)
    assert not s.survivors(), s.survivors()
    gone = Serve(ray_tmp / "x", str(tmp_path / "nothing"), "--port", str(free_port()))
    assert gone.proc.wait(120) == 2, gone.output[-2000:]
    assert "does not exist" in gone.output and not list((ray_tmp / "x").glob("ray/session_*"))


def test_an_app_that_cannot_deploy_ends_the_start_with_exit_2_naming_its_error(ray_tmp: Path,
                                                                             tmp_path: Path) -> None:
    """A replica whose start raises (here: a --lora file that is no safetensors file, read by the
    replica) fails the deploy: the launcher says the replica's own error and exits 2 at once,
    without a drain (no job ever ran) and with its cluster gone."""
    (tmp_path / "adapter.safetensors").write_bytes(b"not a safetensors file")
    s = Serve(ray_tmp, "--port", str(free_port()), "--lora", f"bad={tmp_path / 'adapter.safetensors'}")
    end = time.monotonic() + 300  # a bound on the wait, not a measurement
    while s.proc.poll() is None and time.monotonic() < end:
        s.seen |= set(descendants(s.proc.pid))
        time.sleep(0.05)
    assert s.proc.wait(10) == 2, s.output[-3000:]
    said = "the app failed to deploy: service.models.lora_ref.LoraError: adapter 'bad'"
    assert said in s.output, s.output[-3000:]
    assert "draining" not in s.output
    time.sleep(0.5)
    assert not s.survivors(), s.survivors()


def test_dead_address_fails_fast_naming_it(ray_tmp: Path) -> None:
    dead = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    s = Serve(ray_tmp, "--address", dead, "--port", str(free_port()), "--join-timeout-s", "20")
    assert s.proc.wait(120) == 2, s.output[-2000:]
    assert time.monotonic() - t0 < 60
    assert f"cannot reach the Ray cluster at {dead}" in s.output


def test_a_running_cluster_is_joined_deployed_to_again_and_its_problems_said(ray_tmp: Path,
                                                                          tmp_path: Path) -> None:
    """`ray start --head` once (Ray's token authentication on: ~/.ray/auth_token exists), then
    `dloserve serve --address` as a user redeploys: without RAY_AUTH_MODE=token the join fails
    (Ray sends its token to an explicit address only then) and the error says what to set; with
    it the service serves; a second one while it runs is refused (it would replace the app); the
    first one stopped takes the Serve it started along, so the next one serves on its own port;
    where Serve ran before on another port, the start says so instead of waiting; on Serve's own
    port (its proxy listens there) it serves, and leaves Serve running when it stops."""
    import os
    import secrets
    import subprocess
    import sys
    import threading

    home, gcs = tmp_path / "home", free_port()
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    env = {**{k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")},
           "HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0"}
    bin_dir = Path(sys.executable).parent
    address = f"127.0.0.1:{gcs}"

    def serve(n: int, port: int, auth: str = "token") -> Serve:
        return Serve(ray_tmp / str(n), "--address", address, "--port", str(port), "--gpus-per-rank", "0",
                     "--cpus-per-rank", "0.5", env={"HOME": str(home), "RAY_AUTH_MODE": auth})

    # --block: the cluster's processes stay below this one, so the test stops this cluster alone
    # (`ray stop` stops every cluster on the machine, the test session's too). RAY_AUTH_MODE unset,
    # as in a user's shell.
    cmd = [str(bin_dir / "ray"), "start", "--head", "--block", f"--port={gcs}", "--num-cpus=2",
           f"--temp-dir={ray_tmp / 'ray'}", "--include-dashboard=false"]
    head = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    up = threading.Event()

    def read() -> None:  # until Ray says its processes run, then on (a full pipe would block it)
        assert head.stdout is not None
        for line in head.stdout:
            if "Ray runtime started" in line:
                up.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert up.wait(120) and head.poll() is None, "ray start --head --block did not start"
        plain = serve(1, free_port(), auth="")
        assert plain.proc.wait(180) == 2, plain.output[-2000:]
        assert "could not join the Ray cluster" in plain.output and "RAY_AUTH_MODE=token" in plain.output
        first_port = free_port()
        first = serve(2, first_port)
        wait_ready(f"http://127.0.0.1:{first_port}", 240)
        second = serve(3, free_port())
        assert second.proc.wait(120) == 2, second.output[-2000:]
        assert "an application named dloserve already runs on this cluster" in second.output
        assert httpx.get(f"http://127.0.0.1:{first_port}/readyz", timeout=10).status_code == 200
        first.proc.send_signal(signal.SIGINT)
        assert first.proc.wait(120) == 0, first.output[-2000:]
        again_port = free_port()  # the redeploy: on a port of its own, Serve having gone with the first
        again = serve(4, again_port)
        wait_ready(f"http://127.0.0.1:{again_port}", 240)
        again.proc.send_signal(signal.SIGINT)
        assert again.proc.wait(120) == 0, again.output[-2000:]
        serve_port = free_port()
        start = ["start", "--address", address, "--http-host", "127.0.0.1", "--http-port", str(serve_port)]
        other = subprocess.run([str(bin_dir / "serve"), *start], env={**env, "RAY_AUTH_MODE": "token"},
                               capture_output=True, text=True, timeout=120)
        assert other.returncode == 0, other.stdout[-2000:] + other.stderr[-2000:]
        late = serve(5, free_port())
        assert late.proc.wait(240) == 2, late.output[-2000:]
        assert "its proxies keep the HTTP port it was started with" in late.output, late.output[-2000:]
        on_serve = serve(6, serve_port)  # the port Serve's proxy holds: what the error above advises
        wait_ready(f"http://127.0.0.1:{serve_port}", 240)
        on_serve.proc.send_signal(signal.SIGINT)
        assert on_serve.proc.wait(120) == 0, on_serve.output[-2000:]
        kept = httpx.get(f"http://127.0.0.1:{serve_port}/readyz", timeout=10)  # Serve's proxy: no app
        assert kept.status_code == 404, kept.text
    finally:
        kill_tree([head.pid, *descendants(head.pid)], grace_s=10.0)


@pytest.mark.parametrize(
    ("sig", "moment"),
    [
        (signal.SIGINT, "while Python starts"),
        (signal.SIGTERM, "while Ray starts"),
        (signal.SIGTERM, "while the model loads"),
        (signal.SIGINT, "while the ranks load"),  # the app runs, not yet ready: a drain of nothing
    ],  # while serving: test_exposure.py (SIGINT) and the drain tests below (SIGTERM): once
    # serving, SIGINT and SIGTERM take one path (launch._on_signal, then cluster.shutdown)
)
def test_a_signal_at_any_moment_stops_everything(ray_tmp: Path, sig: int, moment: str) -> None:
    s = Serve(ray_tmp, "--port", str(free_port()))
    if moment == "while Python starts":
        # Once dloserve catches SIGTERM (Python itself does not) it is ours to stop: the
        # signal lands while it still imports.
        s.watch_until(lambda: catches(s.proc.pid, signal.SIGTERM), timeout=60)
    elif moment == "while Ray starts":
        s.watch_until(lambda: bool(matching(s.proc.pid, "gcs_server")), timeout=120)
    elif moment == "while the model loads":
        s.watch_until(lambda: "deploying" in s.output, timeout=180)
    else:
        s.watch_until(lambda: bool(matching(s.proc.pid, "RankActor")), timeout=180)
    assert s.stop(sig) == 0, s.output[-2000:]
    assert not s.survivors(), s.survivors()


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (SigCgt in /proc/PID/status)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except OSError:
        pass
    return False



def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/videos", json=body, timeout=30)


def test_sigterm_drains_then_stops(ray_tmp: Path, tmp_path: Path, demo_model: str) -> None:
    """While draining: new work 503 with Retry-After, reads answer, the queued job fails at
    once, the running one finishes; after the drain reads keep answering until the port
    refuses connections (never a 404 for a job that exists); then every process is gone."""
    import json
    import threading

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # A drain ends when its running job does: the long timeout costs nothing when the machine is
    # idle, and under load (1000 steps took over 120 s at load 12-14) the job still finishes.
    # 250 steps: the checks made while it runs (draining, the refused POST, the reads) ended at its
    # step 2 of 1000, 1.1 s after its first step, while 1000 steps took 70 s (at load 6-13); the
    # job outlasts them ~15x, and make e2e waits ~3/4 less for it.
    s = Serve(ray_tmp, demo_model, "--port", str(port), "--results-dir", str(tmp_path),
              "--drain-timeout-s", "400", "--max-steps", "250")
    s.watch_until(lambda: "dloserve ready at" in s.output, timeout=240)
    running = _post(url, {"prompt": "finishes during the drain", "num_inference_steps": 250}).json()["id"]
    queued = _post(url, {"prompt": "never starts"}).json()["id"]
    s.watch_until(lambda: httpx.get(f"{url}/v1/videos/{running}").json()["progress"] > 0, timeout=120)
    s.seen |= set(descendants(s.proc.pid))
    reads: list[int] = []  # the status of every read from the drain until the port closes

    def poll() -> None:
        while True:
            for vid in (running, queued):
                try:
                    reads.append(httpx.get(f"{url}/v1/videos/{vid}", timeout=10).status_code)
                except httpx.HTTPError:
                    return  # the port is closed: HTTP has stopped

    s.proc.send_signal(signal.SIGTERM)
    # The launcher prints "draining" before the replica hears it: wait for the replica.
    s.watch_until(lambda: httpx.get(f"{url}/readyz").json()["state"] == "draining", timeout=60)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    refused = _post(url, {"prompt": "too late"})
    assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
    assert httpx.get(f"{url}/v1/videos/{running}").status_code == 200
    assert httpx.get(f"{url}/readyz").json()["state"] == "draining"
    assert s.proc.wait(500) == 0, s.output[-2000:]
    poller.join(30)
    assert not poller.is_alive()  # it stopped on a refused connection
    assert reads and set(reads) <= {200, 503}, sorted(set(reads))  # before: ~2 s of 404 after the drain
    time.sleep(0.5)
    assert not s.survivors(), s.survivors()
    final = {v: json.loads((tmp_path / f"{v}.json").read_text()) for v in (running, queued)}
    assert final[running]["status"] == "completed", final[running]
    assert final[queued]["status"] == "failed" and "service stopped" in final[queued]["error"]["message"]


def test_a_second_signal_during_the_drain_stops_at_once(ray_tmp: Path, demo_model: str) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    s = Serve(ray_tmp, demo_model, "--port", str(port), "--drain-timeout-s", "600", "--max-steps", "1000")
    s.watch_until(lambda: "dloserve ready at" in s.output, timeout=240)
    vid = _post(url, {"prompt": "long", "num_inference_steps": 1000}).json()["id"]
    s.watch_until(lambda: httpx.get(f"{url}/v1/videos/{vid}").json()["progress"] > 0, timeout=120)
    s.seen |= set(descendants(s.proc.pid))
    s.proc.send_signal(signal.SIGTERM)
    s.watch_until(lambda: "draining" in s.output, timeout=60)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGINT)
    s.proc.wait(60)
    assert time.monotonic() - t0 < 30
    time.sleep(0.5)
    assert not s.survivors(), s.survivors()
