"""One Serve app (DP=2 AllGather, continuous scheduling, demo model) shared by the HTTP tests,
and one with API keys (DP1, under /keyed) shared by the key and adapter tests."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.api.hostproc import descendants
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]

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
        data_parallel_size=2,
        offload={"mode": "allgather"},  # one group of two ranks that gather (auto: tests/engine)
        cpus_per_rank=0.5,
        gpus_per_rank=GPUS_PER_RANK,
        queue_size=QUEUE_SIZE,
        results_url=str(tmp_path_factory.mktemp("results")),
        pg_timeout_s=60,
        wave_deadline_base_s=60, wave_deadline_per_forward_s=1.0,
    )
    port = free_port()
    t0 = time.monotonic()
    deploy(cfg, "127.0.0.1", port, name="dloserve-test")
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, 180)
    print(f"\ntime to ready: {time.monotonic() - t0:.1f}s")
    yield url
    serve.delete("dloserve-test")


# The keyed app: test_security.py's two keys and admin, test_lora_keys.py's two keys.
KEY_A, KEY_B = "sk-test-alice-0123456789", "sk-test-bob-9876543210"
ADMIN = "sk-test-admin-5555555555"
LORA_KEY_A, LORA_KEY_B = "sk-lora-alice-0123456789", "sk-lora-bob-9876543210"
BODY_TIMEOUT_S = 10.0  # the held uploads of a test outlast its checks
UPLOADS_PER_KEY = 8  # the FIFO test's six registrations of one key and its job fit under it
LORA_CAP = 3  # max_loras_per_key


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="session")
def keyed_lora_dir(demo_model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The adapters the keyed app's --lora-dir holds: the server's, alice's, bob's, a bad file."""
    from service.models.demo.lora import write_demo_lora

    d = tmp_path_factory.mktemp("keyed-loras")
    for seed, name in enumerate(("server", "alice", "bob")):
        write_demo_lora(demo_model, d / f"{name}.safetensors", rank=4, seed=seed + 1)
    (d / "junk.safetensors").write_bytes(b"not safetensors")
    return d


@pytest.fixture(scope="session")
def keyed(app_url: str, demo_model: str, keyed_lora_dir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second app (DP1, under /keyed) with API keys, an admin key, per-key limits and
    adapters: test_security.py's keys and test_lora_keys.py's share it (each app start costs
    `make test` 30-45 s). The two modules' keys are apart, so neither sees the other's jobs,
    adapters or quotas; the per-key limits are per key."""
    from ray import serve

    from service.api.app import build_app
    from service.api.service import ServiceConfig

    cfg = ServiceConfig(
        model=demo_model, data_parallel_size=1, cpus_per_rank=0.25, encoders_per_rank=0,
        results_url=str(tmp_path_factory.mktemp("keyed")), pg_timeout_s=60,
        api_key_hashes=[key_hash(k) for k in (KEY_A, KEY_B, LORA_KEY_A, LORA_KEY_B)],
        admin_key_hashes=[key_hash(ADMIN)],
        key_quotas={key_hash(KEY_B): {"min_priority": -5}},
        max_queued_per_key=1, body_timeout_s=BODY_TIMEOUT_S, first_byte_timeout_s=1.0,
        max_uploads_per_key=UPLOADS_PER_KEY,
        loras={"server": str(keyed_lora_dir / "server.safetensors")}, lora_dir=[str(keyed_lora_dir)],
        max_loras_per_key=LORA_CAP,
    )
    serve.run(build_app(cfg.model_dump()), name="keyed", route_prefix="/keyed")
    url = f"{app_url}/keyed"
    wait_ready(url, 180)
    yield url
    serve.delete("keyed")


def wait_ready(url: str, timeout: float, headers: dict | None = None) -> dict:
    """Until every rank group serves (200 comes once one does: "degraded" is not yet all)."""
    end = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < end:
        try:
            r = httpx.get(f"{url}/readyz", timeout=5, headers=headers)
            last = r.json()
            if r.status_code == 200 and last.get("state", "ready") == "ready":  # no key: no state
                return last
        except (httpx.HTTPError, ValueError) as e:  # ValueError: Serve's own text before the app routes
            last = e
        time.sleep(0.25)
    raise AssertionError(f"not ready after {timeout}s: {last}")


def wait_final(url: str, vid: str, timeout: float = 120, headers: dict | None = None) -> dict:
    end = time.monotonic() + timeout
    v: dict | str = "no answer yet"
    while time.monotonic() < end:
        try:  # a read may time out while the proxy still routes to a replica that just died
            v = httpx.get(f"{url}/v1/videos/{vid}", timeout=10, headers=headers).json()
        except httpx.TimeoutException as e:
            v = f"read timed out: {e!r}"
            continue
        if v["status"] in ("completed", "failed", "cancelled"):
            return v
        time.sleep(0.1)
    raise AssertionError(f"{vid} not final after {timeout}s: {v}")


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    """A short private RAY_TMPDIR (Ray's socket paths must stay under 108 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


_started: list[Serve] = []


@pytest.fixture(autouse=True)
def _no_leftover_services() -> Iterator[None]:
    """A test that fails half-way must not leave its `dloserve serve` (and its cluster) behind."""
    yield
    from service.api.hostproc import kill_tree

    while _started:
        s = _started.pop()
        if s.proc.poll() is None:
            s.seen |= set(descendants(s.proc.pid))
            kill_tree([s.proc.pid, *s.seen], grace_s=10)


class Serve:
    """`dloserve serve` in a subprocess; remembers every process it ever had below it."""

    def __init__(self, ray_tmp: Path, *args: str, env: dict[str, str] | None = None) -> None:
        extra = env or {}
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update({"RAY_TMPDIR": str(ray_tmp), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **extra})
        self.proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", *args], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.seen: set[int] = set()
        _started.append(self)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def watch_until(self, cond, timeout: float) -> None:  # noqa: ANN001
        end = time.monotonic() + timeout
        while not cond():
            self.seen |= set(descendants(self.proc.pid))
            assert self.proc.poll() is None, self.output[-3000:]
            assert time.monotonic() < end, self.output[-3000:]
            time.sleep(0.05)
        self.seen |= set(descendants(self.proc.pid))

    def stop(self, sig: int, timeout: float = 90) -> int:
        self.seen |= set(descendants(self.proc.pid))
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout)
        time.sleep(0.5)
        return rc

    def survivors(self) -> list[str]:
        alive = []
        for pid in self.seen:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:80]
            except OSError:
                continue
            if stat.rsplit(")", 1)[1].split()[0] != "Z":
                alive.append(f"{pid} {cmd.decode(errors='replace')}")
        return alive
