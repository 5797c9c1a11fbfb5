"""Where `ray.init`'s seconds go in `dloserve serve`'s start, and what slows it.

Each variant runs in a fresh process on a fresh local cluster (as the launcher makes it:
no dashboard, the loopback node address) and reports ``ray.init``'s seconds, then the time
until four trivial actors (Serve's controller, proxy, the replica and the job store, in
number) have answered, and when Ray's processes began (their log files' times). Variants:
``alone``; ``host`` with a warm host's imports in another process beside it (what
`serve` runs); ``launcher`` with that and, on threads of the same process, torch's import
and the Serve app's (the launcher's model check and app import); ``noprestart`` as
``launcher`` with Ray's idle-worker prestart off. ``--imports`` adds `python -X importtime`
of a warm host's imports and of the Serve app's module, summed by top-level package.

    python loadtest/bench_ray_start.py --variants alone,host,launcher --repeat 2 --imports \
        --out loadtest/results/h200-ray-start-DATE.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from loadtest.reporting import header  # noqa: E402

CHILD = r"""
import json, os, subprocess, sys, threading, time
variant = sys.argv[1]
t0 = time.time()
import ray
from service.api.ray_hooks import loopback_node, session_dirs
loopback_node()
side = []
if variant in ("host", "launcher", "noprestart"):
    side.append(subprocess.Popen([sys.executable, "-c",
        "from service.engine.warmhost import import_for; import_for(None, 1)"]))
if variant in ("launcher", "noprestart"):
    def imp(name):
        __import__(name)
    for name in ("torch", "service.api.app"):
        threading.Thread(target=imp, args=(name,), daemon=True).start()
t1 = time.time()
ray.init(address="local", include_dashboard=False, dashboard_host="127.0.0.1")
t2 = time.time()

@ray.remote(num_cpus=0)
class Nop:
    def ping(self):
        return os.getpid()

actors = [Nop.remote() for _ in range(4)]
ray.get([a.ping.remote() for a in actors])
t3 = time.time()
logs = str(session_dirs()[0] / "logs")
began = {}
for f in sorted(os.listdir(logs)):
    if f.endswith((".err", ".out", ".log")) and not f.startswith(("worker-", "python-core")):
        at = round(os.stat(os.path.join(logs, f)).st_ctime - t1, 2)  # the earliest: made at its start
        began[f.rsplit(".", 1)[0]] = min(at, began.get(f.rsplit(".", 1)[0], at))
workers = sorted(os.stat(os.path.join(logs, f)).st_ctime - t1 for f in os.listdir(logs)
                 if f.startswith("worker-") and f.endswith(".err"))
for p in side:
    p.wait()
print("RESULT " + json.dumps({"variant": variant, "import_ray_s": round(t1 - t0, 2),
      "init_s": round(t2 - t1, 2), "four_actors_s": round(t3 - t2, 2),
      "side_done_s": round(time.time() - t1, 2), "began_s": began,
      "workers": {"count": len(workers), "first_s": round(workers[0], 2) if workers else None}}))
ray.shutdown()
"""


def run_variant(variant: str) -> dict:
    env = dict(os.environ)
    if variant == "noprestart":
        env["RAY_enable_worker_prestart"] = "0"
        env["RAY_prestart_worker_first_driver"] = "0"
    p = subprocess.run([sys.executable, "-c", CHILD, variant], env=env, capture_output=True, text=True,
                       timeout=300)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"variant": variant, "error": (p.stderr or p.stdout)[-2000:]}


def import_profile(statement: str) -> dict:
    p = subprocess.run([sys.executable, "-X", "importtime", "-c", statement], capture_output=True,
                       text=True, timeout=300)
    by_package: collections.Counter[str] = collections.Counter()
    for line in p.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|\s*(\S+)", line)
        if m:
            by_package[m.group(3).split(".")[0]] += int(m.group(1))
    total = sum(by_package.values())
    return {"statement": statement, "total_s": round(total / 1e6, 2),
            "top_s": {k: round(v / 1e6, 2) for k, v in by_package.most_common(15)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="alone,host,launcher")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--imports", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs = []
    for _ in range(args.repeat):
        for v in args.variants.split(","):
            runs.append(run_variant(v))
            print(json.dumps(runs[-1]), flush=True)
    result: dict = {**header(), "runs": runs}
    if args.imports:
        result["imports"] = [
            import_profile("from service.engine.warmhost import import_for; import_for(None, 1)"),
            import_profile("import service.api.app")]
        print(json.dumps(result["imports"], indent=1), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
