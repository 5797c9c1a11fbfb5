"""Same frames, same MP4: many encodes in processes whose heaps, CPUs and timing differ.

Issue 20 made x264 multi-threaded (``X264_THREADS`` frame threads, service/models/video.py).
x264 promises a function of input and options for a fixed thread count unless told to be
non-deterministic; this checks that promise, and issue 9's fix, on our settings. Every
worker process encodes the same inputs (seeded clips, rebuilt in each process and
checked by their own SHA-256) in its own shuffled order, and differs from the others in:

- heap contents: ``MALLOC_PERTURB_`` (glibc fills fresh allocations with a chosen byte),
  ``MALLOC_MMAP_THRESHOLD_`` (large buffers from the reused heap instead of fresh zero
  pages) and a churn of allocations filled with a per-worker byte before every encode;
- CPUs: all of them, or one (``sched_setaffinity``), and a nice level;
- thread timing: more workers than cores, plus ``--load`` busy processes beside them.

Sizes are not multiples of 128 px (832x480, 480x832, 96x96, 97x61) where x264's AVX-512
macroblock tree once read memory it never wrote. Prints a table, writes the JSON
(command, machine, date) and exits 1 if any input gave more than one file.

``--fault`` puts back a known cause of trouble in the workers only (``avx512``: x264's
full instruction set; ``non-deterministic``: x264's own switch; ``auto-threads``: the
thread count taken from the process's CPUs): the check must then find several files.

    python loadtest/encode_determinism.py --out loadtest/results/cpu-encode-determinism-DATE.json
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import reporting

SMALL = {  # name: (kind, width, height, frames); each worker encodes each of these every round
    "noise-96x96x9": ("noise", 96, 96, 9),
    "smooth-96x96x9": ("smooth", 96, 96, 9),
    "noise-97x61x9": ("noise", 97, 61, 9),
    "noise-832x480x2": ("noise", 832, 480, 2),
    "smooth-832x480x5": ("smooth", 832, 480, 5),
    "noise-480x832x2": ("noise", 480, 832, 2),
    "smooth-480x832x5": ("smooth", 480, 832, 5),
}
FULL = {  # the service's largest common shape, encoded --full-reps times each
    "noise-832x480x81": ("noise", 832, 480, 81),
    "smooth-832x480x81": ("smooth", 832, 480, 81),
    "noise-480x832x81": ("noise", 480, 832, 81),
    "smooth-480x832x81": ("smooth", 480, 832, 81),
}
PERTURB = [None, 0x01, 0x55, 0xAA, 0xFF, 0x2A, 0x80, 0x13]
FPS = 16
FAULTS = ("avx512", "non-deterministic", "auto-threads")


# -- worker ------------------------------------------------------------------------------

def _inject(fault: str | None) -> None:
    """Put a known cause of non-determinism back into this process's encoder."""
    if fault is None:
        return
    from service.models import video

    if fault == "avx512":
        mask = video._x264_cpu_flags()
        video._x264_params = lambda: f"asm={mask}"  # type: ignore[assignment]
        return
    base = video.x264_options

    def patched(threads: int = video.X264_THREADS) -> dict[str, str]:
        opts = base(threads)
        if fault == "non-deterministic":
            opts["x264-params"] = opts["x264-params"].replace("non-deterministic=0", "non-deterministic=1")
        else:  # auto-threads: what x264 picks from sched_getaffinity (cores x 1.5)
            opts["x264-params"] = opts["x264-params"].replace(f"threads={threads}", "threads=auto")
        return opts

    video.x264_options = patched  # type: ignore[assignment]


def _churn(rng: random.Random, keep: list[Any], fill: int) -> None:
    """Allocate, fill and free buffers of many sizes, so the heap x264 gets holds our bytes."""
    import numpy as np

    for _ in range(24):
        n = int(2 ** rng.uniform(6, 22))  # 64 B .. 4 MiB
        buf = np.full(n, fill, dtype=np.uint8) if rng.random() < 0.5 else bytearray([fill]) * n
        keep.append(buf)
    rng.shuffle(keep)
    del keep[rng.randrange(8, 24):]  # free a random part; the rest lives on


def worker(args: argparse.Namespace) -> int:
    from clips import clip, frames_sha256

    from service.models.video import encode_mp4, x264_settings

    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    os.nice(args.nice)
    _inject(args.fault)
    rng = random.Random(args.worker)
    keep: list[Any] = []
    inputs = {**SMALL, **FULL}
    cache: dict[str, tuple[Any, str]] = {}
    plan = []
    for _ in range(args.rounds):
        names = [n for n in SMALL if _wanted(n, args.inputs)]
        rng.shuffle(names)
        plan += names
    plan += [n for i, n in enumerate(args.full.split(",")) if n]
    for name in plan:
        if name not in cache:
            frames = clip(*_shape(inputs[name]))
            cache[name] = (frames, frames_sha256(frames))
        frames, fsha = cache[name]
        _churn(rng, keep, args.fill)
        t0 = time.perf_counter()
        data = encode_mp4(frames, FPS)
        s = x264_settings(data)
        print(json.dumps({"input": name, "sha256": hashlib.sha256(data).hexdigest(), "frames_sha256": fsha,
                          "s": round(time.perf_counter() - t0, 3), "threads": s.get("threads"),
                          "sliced_threads": s.get("sliced_threads")}), flush=True)
    return 0


def _wanted(name: str, only: str | None) -> bool:
    return only is None or name in only.split(",")


def _shape(spec: tuple[str, int, int, int]) -> tuple[str, int, int, int]:
    kind, w, h, t = spec
    return kind, t, h, w


# -- driver ------------------------------------------------------------------------------

def _load(seconds: float) -> None:
    """A busy process with bursts and pauses, so the workers' threads are preempted unevenly."""
    rng = random.Random(os.getpid())
    end = time.monotonic() + seconds
    parent = os.getppid()
    while time.monotonic() < end and os.getppid() == parent:  # never outlive the driver
        burst = time.monotonic() + rng.uniform(0.001, 0.05)
        while time.monotonic() < burst:
            pass
        time.sleep(rng.uniform(0, 0.01))


def encoder_facts() -> dict[str, Any]:
    """The machine's facts for this benchmark beyond the harness's: x264's settings, AVX-512."""
    import av
    import numpy as np

    from service.models import video

    try:
        flags = next((set(ln.split(":", 1)[1].split()) for ln in open("/proc/cpuinfo")
                      if ln.startswith("flags")), set())
    except OSError:
        flags = set()
    return dict(avx512f="avx512f" in flags, numpy=np.__version__, av=av.__version__,
                             x264_params=video.x264_options()["x264-params"], x264_threads=video.X264_THREADS)


def run(args: argparse.Namespace) -> dict[str, Any]:
    ncpu = len(os.sched_getaffinity(0))
    cpus = sorted(os.sched_getaffinity(0))
    full_names = [n for n in FULL if _wanted(n, args.inputs) for _ in range(args.full_reps)]
    full_by_worker: list[list[str]] = [[] for _ in range(args.processes)]
    for i, name in enumerate(full_names):
        full_by_worker[i % args.processes].append(name)
    workers = []
    for w in range(args.processes):
        perturb = PERTURB[w % len(PERTURB)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        if perturb is not None:
            env["MALLOC_PERTURB_"] = str(perturb)
        if w % 2:
            env["MALLOC_MMAP_THRESHOLD_"] = str(32 * 2**20)  # glibc's maximum: big buffers from the heap
        cpu = cpus[w % ncpu] if (ncpu > 1 and w % 3 == 2) else None
        cfg = {"worker": w, "MALLOC_PERTURB_": perturb,
               "MALLOC_MMAP_THRESHOLD_": env.get("MALLOC_MMAP_THRESHOLD_"), "cpu": cpu,
               "nice": (w % 3) * 5, "fill": (w * 37 + 11) % 256, "full": full_by_worker[w]}
        cmd = [sys.executable, __file__, "--worker", str(w), "--rounds", str(args.rounds),
               "--nice", str(cfg["nice"]), "--fill", str(cfg["fill"]), "--full", ",".join(cfg["full"])]
        if cpu is not None:
            cmd += ["--cpu", str(cpu)]
        if args.fault:
            cmd += ["--fault", args.fault]
        if args.inputs:
            cmd += ["--inputs", args.inputs]
        workers.append((cfg, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)))
    loaders = [subprocess.Popen([sys.executable, __file__, "--busy", str(args.load_s)])
               for _ in range(args.load)]
    t0 = time.monotonic()
    records: list[dict[str, Any]] = []
    failed = []
    try:
        for cfg, p in workers:
            out, _ = p.communicate()
            for line in out.splitlines():
                records.append({**json.loads(line), "worker": cfg["worker"]})
            if p.returncode:
                failed.append({"worker": cfg["worker"], "rc": p.returncode})
    finally:
        for _, p in workers:
            if p.poll() is None:
                p.kill()
        for p in loaders:
            p.kill()
            p.wait()
    wall = time.monotonic() - t0
    per: dict[str, dict[str, Any]] = {}
    for name in [*SMALL, *FULL]:
        rs = [r for r in records if r["input"] == name]
        if not rs:
            continue
        digests = collections.Counter(r["sha256"] for r in rs)
        per[name] = {"encodes": len(rs), "distinct_sha256": len(digests),
                     "sha256": dict(digests.most_common()),
                     "distinct_frames_sha256": len({r["frames_sha256"] for r in rs}),
                     "workers": len({r["worker"] for r in rs}),
                     "x264_threads": sorted({r["threads"] for r in rs}),
                     "sliced_threads": sorted({r["sliced_threads"] for r in rs}),
                     "median_s": sorted(r["s"] for r in rs)[len(rs) // 2]}
    return {**reporting.header(**encoder_facts()), "fault": args.fault, "fps": FPS,
            "workers": [cfg for cfg, _ in workers], "load_processes": args.load,
            "wall_s": round(wall, 1), "total_encodes": len(records), "failed_workers": failed,
            "one_file_per_input": bool(per) and not failed and all(
                v["distinct_sha256"] == 1 and v["distinct_frames_sha256"] == 1 for v in per.values()),
            "inputs": per}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--processes", type=int, default=6, help="worker processes (more than cores: on purpose)")
    p.add_argument("--rounds", type=int, default=24, help="rounds of the small inputs per worker")
    p.add_argument("--full-reps", type=int, default=3, help="encodes of each 81-frame input, in all")
    p.add_argument("--load", type=int, default=2, help="busy processes beside the workers")
    p.add_argument("--load-s", type=float, default=7200.0, help="(stopped when the workers end)")
    p.add_argument("--fault", choices=FAULTS, default=None, help="reintroduce a known cause (must fail)")
    p.add_argument("--inputs", default=None, help="comma-separated input names (default: all)")
    p.add_argument("--out", type=Path, default=None, help="JSON results (default: print only)")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--busy", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--cpu", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--nice", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--fill", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--full", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.busy is not None:
        _load(args.busy)
        return 0
    if args.worker is not None:
        return worker(args)
    res = run(args)
    print(f"{res['total_encodes']} encodes in {res['wall_s']} s, {len(res['workers'])} processes, "
          f"fault={res['fault']}")
    for name, v in res["inputs"].items():
        print(f"  {name:20s} {v['encodes']:5d} encodes  {v['distinct_sha256']} distinct SHA-256  "
              f"frames {v['distinct_frames_sha256']}  threads {v['x264_threads']}  median {v['median_s']} s")
    print("one file per input:", res["one_file_per_input"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2) + "\n")
        print("wrote", args.out)
    return 0 if res["one_file_per_input"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
