"""Closed-loop HTTP load against a running dloserve: throughput, latency, waves.

    .venv/bin/python loadtest/http_load.py --url http://127.0.0.1:8000 --concurrency 4 --requests 16

Each of ``--concurrency`` clients submits a job, polls it to the end, and repeats until
``--requests`` jobs are done. 429s are retried after Retry-After (and counted). Prints a
JSON summary (and writes it, with the command, machine and date, to ``--out``): videos/hour,
end-to-end latency percentiles, failures, and the wave sizes the service reported at
/v1/waves (to see whether DP waves filled up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from reporting import header, write_report


def one_job(client: httpx.Client, body: dict, poll_s: float, timeout_s: float) -> tuple[str, float, int]:
    """Submit and wait; returns (final status, seconds, 429s seen)."""
    throttled = 0
    t0 = time.monotonic()
    while True:
        r = client.post("/v1/videos", json=body)
        if r.status_code != 429:
            break
        throttled += 1
        time.sleep(float(r.headers.get("retry-after", "1")))
    if r.status_code != 202:
        return f"http_{r.status_code}", time.monotonic() - t0, throttled
    vid = r.json()["id"]
    while time.monotonic() - t0 < timeout_s:
        v = client.get(f"/v1/videos/{vid}").json()
        if v["status"] in ("completed", "failed"):
            if v["status"] == "completed":
                client.get(f"/v1/videos/{vid}/content").raise_for_status()
            return v["status"], time.monotonic() - t0, throttled
        time.sleep(poll_s)
    return "timeout", time.monotonic() - t0, throttled


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--body", default='{"prompt": "a red fox running through snow"}',
                   help="JSON body; seed is set per request")
    p.add_argument("--poll-s", type=float, default=0.1)
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--out", help="JSON path for the summary (printed either way)")
    args = p.parse_args()
    base = json.loads(args.body)
    counter = iter(range(args.requests))
    lock = threading.Lock()
    results: list[tuple[str, float, int]] = []

    def client_loop() -> None:
        with httpx.Client(base_url=args.url, timeout=60) as c:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                res = one_job(c, {**base, "seed": base.get("seed", 0) + i}, args.poll_s, args.timeout_s)
                with lock:
                    results.append(res)

    waves_before = {w["wave"] for w in httpx.get(f"{args.url}/v1/waves").json()}
    t0 = time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool:
        for f in [pool.submit(client_loop) for _ in range(args.concurrency)]:
            f.result()
    wall = time.monotonic() - t0
    waves = [w for w in httpx.get(f"{args.url}/v1/waves").json() if w["wave"] not in waves_before]
    lat = sorted(s for st, s, _ in results if st == "completed")
    done = len(lat)
    summary = {
        **header(),
        "url": args.url, "concurrency": args.concurrency,
        "requests": len(results),
        "completed": done,
        "failed": {st: sum(1 for r in results if r[0] == st) for st in {r[0] for r in results}
                   if st != "completed"},
        "throttled_429": sum(r[2] for r in results),
        "wall_s": round(wall, 2),
        "videos_per_hour": round(done / wall * 3600, 1) if wall else 0.0,
        "latency_s": {
            "p50": round(statistics.median(lat), 3) if lat else None,
            "p95": round(lat[min(len(lat) - 1, int(0.95 * len(lat)))], 3) if lat else None,
            "max": round(lat[-1], 3) if lat else None,
        },
        "wave_sizes": sorted(w["size"] for w in waves),
        "mean_wave_s": round(statistics.mean(w.get("latency_s", 0) for w in waves), 3) if waves else None,
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        write_report(summary, args.out)
    return 0 if done == len(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
