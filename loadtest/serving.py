"""What the HTTP benchmarks share (serve_bench, bench_startup): start ``dloserve serve`` as a
process group of its own, wait for /readyz, find its rank processes, poll a video to its end,
stop it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
FINAL = ("completed", "failed", "cancelled")


def start_serve(cmd: list[str], log: IO[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """``cmd`` (a ``dloserve serve`` line) in the repository root, its output to ``log``, in a
    session of its own so ``stop_serve`` reaches every process it starts."""
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=env)


def wait_ready(url: str, timeout: float, proc: subprocess.Popen | None = None, poll_s: float = 0.1) -> float:
    """Seconds until ``url``/readyz answers 200; RuntimeError if ``proc`` exits first."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"dloserve serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{url} not ready after {timeout} s")


def pids_matching(root: int, needle: str) -> list[int]:
    """Processes below ``root`` whose command line holds ``needle`` (Ray titles a rank's
    process ``ray::RankActor...``): the benchmark's own view, not the service's."""
    try:
        below = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in below:
        try:
            if needle in " ".join(p.cmdline()):
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def final(url: str, vid: str, timeout: float, poll_s: float = 0.2) -> dict[str, Any]:
    """The video object once its status is final."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = httpx.get(f"{url}/v1/videos/{vid}", timeout=30).json()
        if v["status"] in FINAL:
            return v
        time.sleep(poll_s)
    raise TimeoutError(f"{vid} not final after {timeout} s")


def stop_serve(proc: subprocess.Popen, log: IO[str], grace_s: float) -> None:
    """SIGINT to the whole session (the service drains and stops its cluster), SIGKILL after
    ``grace_s``; closes ``log``. A session already gone (serve exited early) is no error."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log.close()


class CompletionHooks:
    """The service's job webhooks, received on 127.0.0.1: when each video's final event came.

    A client that polls sees a completion up to its poll interval late (serve_bench polls
    each video every 0.5 s, 0.25 s late on average, and a makespan ends at the last one); the
    webhook is sent when the record becomes final. ``flags(folder)``: the serve flags that
    send every job's events here (a secret file written in ``folder``)."""

    def __init__(self) -> None:
        import base64
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.arrived: dict[str, float] = {}  # video id -> time.monotonic() of its final event
        self.secret = "whsec_" + base64.b64encode(os.urandom(32)).decode()
        hooks = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                now = time.monotonic()
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                try:
                    vid = json.loads(body)["data"]["id"]
                    hooks.arrived.setdefault(vid, now)
                except (ValueError, KeyError, TypeError):
                    pass  # not a job event: answered, not recorded (tests/loadtest/test_serving.py)
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                return  # http.server logs every request to stderr: the benchmark's output stays its own

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/hooks"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def flags(self, folder: Path) -> list[str]:
        secret = folder / "webhook-secret"
        secret.write_text(self.secret)
        # a receiver on loopback: the operator's allow flag (a public-only default refuses it)
        return ["--webhook-url", self.url, "--webhook-secret-file", str(secret), "--webhook-allow-private"]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
