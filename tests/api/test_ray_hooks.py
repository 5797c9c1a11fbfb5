"""Ray's private modules are used in one module only, and each hook there falls back to Ray's
public API: on an untested Ray, with ``DLOSERVE_RAY_PUBLIC=1``, and on any error in it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from service.api import ray_hooks
from tests.api.conftest import Serve, wait_final
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_only_ray_hooks_imports_rays_private_modules() -> None:
    private = re.compile(r"\bray(\.serve)?\._private\b|\bray_constants\b")
    found = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "service").rglob("*.py"))
             if private.search(p.read_text()) and p.name != "ray_hooks.py"]
    assert found == []


def test_an_untested_ray_or_the_variable_turns_the_hooks_off(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    monkeypatch.delenv(ray_hooks.PUBLIC_ENV, raising=False)
    assert ray_hooks.private_ok() == ray.__version__.startswith(ray_hooks.TESTED)
    monkeypatch.setenv(ray_hooks.PUBLIC_ENV, "1")
    assert not ray_hooks.private_ok()
    monkeypatch.setenv(ray_hooks.PUBLIC_ENV, "0")
    monkeypatch.setattr(ray, "__version__", "9.0.0")
    assert not ray_hooks.private_ok()


def test_an_error_in_a_private_hook_takes_the_public_way(tmp_path: Path) -> None:
    """Outside a Ray session the private session folder lookup fails (no node: an
    AttributeError, not an ImportError): the hook says so and Ray's default folders answer."""
    (tmp_path / "ray" / "session_2").mkdir(parents=True)
    (tmp_path / "ray" / "session_latest").symlink_to(tmp_path / "ray" / "session_2")
    env = {k: v for k, v in os.environ.items() if k not in (ray_hooks.PUBLIC_ENV, "RAY_ADDRESS")}
    r = subprocess.run([sys.executable, "-c", "from service.api.ray_hooks import session_dirs; "
                        "print(*session_dirs())"], cwd=ROOT, env={**env, "RAY_TMPDIR": str(tmp_path)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(tmp_path / "ray" / "session_2"), str(tmp_path / "ray")]
    assert "session_dirs: Ray's private hook failed (AttributeError" in r.stderr, r.stderr


@pytest.mark.e2e  # `dloserve serve` in a subprocess, its own Ray cluster
def test_serve_on_rays_public_api_only_makes_a_video_and_stops(ray_tmp: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    s = Serve(ray_tmp, "--port", str(port), "--results-dir", str(tmp_path),
              env={ray_hooks.PUBLIC_ENV: "1"})
    s.watch_until(lambda: "dloserve ready at" in s.output, timeout=240)
    assert f"{ray_hooks.PUBLIC_ENV}=1: Ray's public API only" in s.output
    assert "private hook failed" not in s.output
    r = httpx.post(f"{url}/v1/videos", json={"prompt": "public", "num_inference_steps": 2}, timeout=30)
    assert r.status_code == 202, r.text
    vid = r.json()["id"]
    assert wait_final(url, vid, timeout=180)["status"] == "completed"
    video = httpx.get(f"{url}/v1/videos/{vid}/content", timeout=30)
    assert video.status_code == 200 and video.content[4:8] == b"ftyp"  # an MP4
    assert s.stop(signal.SIGTERM) == 0, s.output[-2000:]
    assert not s.survivors(), s.survivors()
