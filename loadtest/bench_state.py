"""What keeping a request's per-step state costs a rank (engine/state.py): the pipeline
thread's time in ``StateTap.take`` per step (it runs between two forwards, where the tick
thread waits), the pickle that carries the state to the driver (off that thread), and the
write that keeps it in the results folder for a restart (``store_ms``: ``<id>.state`` through
ResultStorage, off the dispatcher thread, at most every ``STATE_EVERY_S`` per job; api/durable.py).

    python loadtest/bench_state.py --shape 1,16,21,60,104 --reps 50 --out loadtest/results/cpu-state-cost.json

The default shape is a 480p x 81 Wan latent (16 channels, 21 latent frames, 60 x 104).
On a CUDA machine ``--device cuda`` measures the asynchronous path (the caller's time is
queuing the copy; ``landed_ms`` is until the state is on the host).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import pickle
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from service.api.durable import state_bytes
from service.api.results import ResultStorage
from service.engine.state import StateTap


def measure(shape: tuple[int, ...], dtype: torch.dtype, device: str, reps: int,
            storage: ResultStorage) -> dict:
    latents = torch.randn(shape, dtype=torch.float32).to(device, dtype)
    tap = StateTap()
    take, landed, pickled, stored, size = [], [], [], [], 0
    for _ in range(reps + 3):  # the first few warm the allocator and the stream
        got = threading.Event()
        box: list = []
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        tap.take(1, 2, latents, lambda st, box=box, got=got: (box.append(st), got.set()))
        t1 = time.perf_counter()
        got.wait()
        t2 = time.perf_counter()
        blob = pickle.dumps(box[0], protocol=5)
        t3 = time.perf_counter()
        storage.put_bytes("video_bench.state", state_bytes(box[0]))
        stored.append(time.perf_counter() - t3)
        size = len(blob)
        take.append(t1 - t0)
        landed.append(t2 - t0)
        pickled.append(t3 - t2)
    tap.close()
    ms = lambda xs: round(1000 * statistics.median(xs[3:]), 3)  # noqa: E731
    return {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "device": device,
            "bytes": latents.numel() * latents.element_size(), "pickled_bytes": size,
            "take_ms_median": ms(take), "landed_ms_median": ms(landed), "pickle_ms_median": ms(pickled),
            "store_ms_median": ms(stored),
            "take_ms_max": round(1000 * max(take[3:]), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1,16,21,60,104")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out")
    ap.add_argument("--results-url", help="where the state files go (default: a temporary folder)")
    a = ap.parse_args()
    shape = tuple(int(x) for x in a.shape.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        storage = ResultStorage(a.results_url or tmp)
        runs = [measure(shape, getattr(torch, d), a.device, a.reps, storage) for d in a.dtypes.split(",")]
    machine = {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
               "cpus": os.cpu_count(), "loadavg": list(os.getloadavg()), "torch": torch.__version__}
    if a.device == "cuda":
        machine["gpu"] = torch.cuda.get_device_name()
    out = {"command": "python loadtest/bench_state.py " + " ".join(sys.argv[1:]),
           "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": machine,
           "reps": a.reps, "runs": runs}
    text = json.dumps(out, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
