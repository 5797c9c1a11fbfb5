"""Probe a fresh `dloserve serve` as a hostile client would; write the figures as JSON.

    python loadtest/security_probe.py --out loadtest/results/cpu-security-DATE.json

- 413: a POST declaring a 100 MB body is answered before any of it is sent (latency);
  then 8 clients stream 100 MB bodies at once: RSS of the Serve proxy and the replica
  before and after.
- Listeners: every listening TCP socket of the service's processes (`--host 127.0.0.1`),
  loopback or not, with the process that holds it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from reporting import header

from service.api.hostproc import descendants, listeners, matching
from service.engine.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0



def declared_413(port: int) -> tuple[int, float]:
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000000\r\n\r\n")
        status = int(s.recv(4096).split(b" ", 2)[1])
    return status, time.monotonic() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ray_tmp = tempfile.mkdtemp(prefix="r", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "HF_HUB_OFFLINE": "1"}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--host", "127.0.0.1",
           "--results-dir", os.path.join(ray_tmp, "results")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < end, "not ready"
            time.sleep(1)
        tree = [proc.pid] + descendants(proc.pid)
        found = listeners(tree)
        status, latency = declared_413(port)
        proxy, replica = matching(proc.pid, "ProxyActor")[0], matching(proc.pid, "ServeReplica")[0]
        before = {"proxy": rss(proxy), "replica": rss(replica)}
        codes: list[int] = []

        def big() -> Iterator[bytes]:
            yield b'{"prompt": "'
            for _ in range(100):
                yield b"x" * 1_000_000

        def client() -> None:
            try:
                r = httpx.post(f"{url}/v1/videos", content=big(), timeout=120,
                               headers={"content-type": "application/json"})
                codes.append(r.status_code)
            except httpx.HTTPError as e:
                codes.append(-1 if "reset" not in str(e).lower() else 0)

        t0 = time.monotonic()
        threads = [threading.Thread(target=client) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        streamed_s = time.monotonic() - t0
        time.sleep(2)
        after = {"proxy": rss(proxy), "replica": rss(replica)}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    res = {
        **header(),
        "declared_100MB": {"status": status, "seconds": round(latency, 3)},
        "streamed_8x100MB": {"statuses": sorted(codes), "seconds": round(streamed_s, 2),
                             "rss_before_mb": {k: round(v / 2**20) for k, v in before.items()},
                             "rss_after_mb": {k: round(v / 2**20) for k, v in after.items()}},
        "listeners": found,
        "non_loopback_listeners": sum(not x["loopback"] for x in found),
    }
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "listeners"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
