"""Issue 49's encode half: x264 settings at equal quality, and encode beside decode through a rank.

Parts (``--parts``, default ``settings,overlap``):

- ``settings``: the same clips encoded at each ``--presets`` x ``--crfs`` with
  ``X264_THREADS`` threads, in this process: CPU and wall seconds, bytes, PSNR (dB, RGB, the
  decoded MP4 against the frames given). Clips: ``demo`` (the trained demo model's own clips,
  made by the model at its default request, joined end to end), ``smooth`` (a panning field at
  832x480x49, nearer a real video), ``noise`` (what the random-weight presets give). For each
  preset, ``equal_quality`` names the highest crf whose PSNR is at least the default's
  (``X264_BASE``) on every clip, with its time and size against the default. ``threads`` adds
  the default at 2x the thread count: whether "the free cores" would keep the bytes.
- ``overlap``: the same requests through one real rank (``RankWorker``, the trained demo model on
  this CPU, one encoder process) with the decoded chunks streamed to the encoder (``overlap``)
  and with the whole clip handed over after the decode (``after``, the code before issue 49),
  runs interleaved ``--reps`` times: seconds from the first assign to the last MP4, the tail
  after the last forward, per-request seconds, and the MP4 digests (they must be equal).

    OMP_NUM_THREADS=1 python loadtest/encode_bench.py --out loadtest/results/cpu-encode-bench-DATE.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import os
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadtest.clips import clip  # noqa: E402
from loadtest.reporting import RESULTS, header, machine_kind, write_report  # noqa: E402
from service.models import video  # noqa: E402


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 99.0 if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def demo_clips(model_dir: str, count: int) -> np.ndarray:
    """``count`` of the trained model's clips at its default request, end to end."""
    from service.models import GenerationRequest, PipelineRunner
    from service.models.demo.score import prompt_set
    from service.models.registry import request_defaults

    runner = PipelineRunner.load(model_dir, "cpu")
    base = GenerationRequest(prompt="-", **request_defaults(model_dir))
    try:
        return np.concatenate([runner.frames(replace(base, prompt=s.prompt, seed=i))
                               for i, s in enumerate(prompt_set()[:count])])
    finally:
        runner.close()


def encode_one(frames: np.ndarray, fps: int, preset: str, crf: int, threads: int) -> dict[str, Any]:
    c0, w0 = time.process_time(), time.perf_counter()
    data = video.encode_mp4(frames, fps, threads=threads, base={"preset": preset, "crf": str(crf)})
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    return {"preset": preset, "crf": crf, "threads": threads, "cpu_s": round(cpu, 3),
            "wall_s": round(wall, 3), "bytes": len(data),
            "psnr_db": round(psnr(video.decode_mp4(data), frames), 3),
            "sha256": hashlib.sha256(data).hexdigest()[:16]}


def settings_part(clips: dict[str, np.ndarray], fps: int, presets: list[str],
                  crfs: list[int]) -> dict[str, Any]:
    base_preset, base_crf = video.X264_BASE["preset"], int(video.X264_BASE["crf"])
    rows = []
    for name, frames in clips.items():
        grid = [(p, c) for p in presets for c in crfs]
        if (base_preset, base_crf) not in grid:
            grid.append((base_preset, base_crf))
        for p, c in grid:
            rows.append({"clip": name, **encode_one(frames, fps, p, c, video.X264_THREADS)})
            print(rows[-1], flush=True)
        more = encode_one(frames, fps, base_preset, base_crf, 2 * video.X264_THREADS)
        rows.append({"clip": name, **more})
    default = {r["clip"]: r for r in rows if (r["preset"], r["crf"], r["threads"]) ==
               (base_preset, base_crf, video.X264_THREADS)}
    equal = {}
    for p in presets:
        ok = [c for c in crfs if all(r["psnr_db"] >= default[r["clip"]]["psnr_db"]
                                     for r in rows if (r["preset"], r["crf"], r["threads"]) ==
                                     (p, c, video.X264_THREADS))]
        if not ok:
            equal[p] = None
            continue
        c = max(ok)
        mine = {r["clip"]: r for r in rows
                if (r["preset"], r["crf"], r["threads"]) == (p, c, video.X264_THREADS)}
        equal[p] = {"crf": c, **{k: {"cpu_ratio": round(mine[k]["cpu_s"] / default[k]["cpu_s"], 3),
                                     "bytes_ratio": round(mine[k]["bytes"] / default[k]["bytes"], 3),
                                     "psnr_db": mine[k]["psnr_db"], "default_psnr_db": default[k]["psnr_db"]}
                                 for k in mine}}
    more = {r["clip"]: r for r in rows if r["threads"] > video.X264_THREADS}
    threads = {k: {"threads": more[k]["threads"], "same_bytes": more[k]["sha256"] == default[k]["sha256"],
                   "cpu_ratio": round(more[k]["cpu_s"] / default[k]["cpu_s"], 3),
                   "wall_ratio": round(more[k]["wall_s"] / default[k]["wall_s"], 3)} for k in default}
    return {"default": f"{base_preset}/crf{base_crf}", "rows": rows, "equal_quality": equal,
            "more_threads": threads}


def run_requests(runner: Any, overlap: bool, reqs: list[Any]) -> dict[str, Any]:
    from service.engine.encoder import Encoder
    from service.engine.events import EventKind
    from service.engine.rank import RankWorker

    enc = Encoder(1, overlap=overlap)
    enc.wait_warm()
    worker = RankWorker(runner, encoder=enc)
    events: list[tuple[float, Any]] = []
    want = {f"r{i}" for i in range(len(reqs))}
    done = threading.Event()

    def pump() -> None:
        finished: set[str] = set()
        while finished != want:
            for e in worker.events(0.5):
                events.append((time.monotonic(), e))
                if e.kind is EventKind.FINISHED:
                    finished.add(e.job_id)
        done.set()

    t = threading.Thread(target=pump, daemon=True)
    try:
        t0 = time.monotonic()
        t.start()
        for i, r in enumerate(reqs):
            worker.assign(f"r{i}", r)
        worker.serve()
        done.wait()
    finally:
        worker.close()
    fin = {e.job_id: (ts, e) for ts, e in events if e.kind is EventKind.FINISHED}
    last_fwd = max(ts for ts, e in events if e.kind is EventKind.FORWARDS_DONE)
    end = max(ts for ts, _ in fin.values())
    errors = [e.error for _, e in fin.values() if e.error]
    return {"seconds": round(end - t0, 3), "tail_s": round(end - last_fwd, 3), "errors": errors,
            "request_s": [round(fin[f"r{i}"][1].seconds, 3) for i in range(len(reqs))],
            "encode_s": [round(fin[f"r{i}"][1].timings.get("encode_s", 0.0), 3) for i in range(len(reqs))],
            "decode_s": [round(fin[f"r{i}"][1].timings.get("decode_s", 0.0), 3) for i in range(len(reqs))],
            "sha256": [hashlib.sha256(fin[f"r{i}"][1].mp4 or b"").hexdigest()[:16] for i in range(len(reqs))]}


def overlap_part(model_dir: str, n: int, reps: int, size: tuple[int, int, int], steps: int) -> dict[str, Any]:
    from service.models import GenerationRequest, PipelineRunner
    from service.models.demo.score import prompt_set
    from service.models.registry import request_defaults

    w, h, f = size
    base = GenerationRequest(prompt="-", **{**request_defaults(model_dir), "width": w, "height": h,
                                            "num_frames": f, "num_inference_steps": steps})
    reqs = [replace(base, prompt=s.prompt, seed=i) for i, s in enumerate(prompt_set()[:n])]
    runner = PipelineRunner.load(model_dir, "cpu")
    runs: dict[str, list[dict[str, Any]]] = {"overlap": [], "after": []}
    try:
        for rep in range(reps):
            for mode in (("overlap", "after") if rep % 2 == 0 else ("after", "overlap")):
                runs[mode].append(run_requests(runner, mode == "overlap", reqs))
                print(mode, {k: v for k, v in runs[mode][-1].items() if k != "sha256"}, flush=True)
    finally:
        runner.close()
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("seconds", "tail_s")}
           for m, rs in runs.items()}
    same = all(r["sha256"] == runs["after"][0]["sha256"] for rs in runs.values() for r in rs)
    return {"requests": n, "size": f"{w}x{h}x{f}", "steps": steps, "runs": runs, "median": med,
            "ratio_seconds_after_over_overlap": round(med["after"]["seconds"] / med["overlap"]["seconds"], 3),
            "ratio_tail_after_over_overlap": round(med["after"]["tail_s"] / med["overlap"]["tail_s"], 3),
            "bytes_equal": same}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="settings,overlap")
    p.add_argument("--clips", default="demo,smooth")
    p.add_argument("--presets", default="ultrafast,superfast,veryfast,faster,fast,medium")
    p.add_argument("--crfs", default="12,14,16,18")
    p.add_argument("--demo-clips", type=int, default=3)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--size", default="256x256x33", help="overlap part: WxHxF of each request")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--model", default=None, help="default: the trained demo model")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from service.models.registry import resolve_model

    model_dir = resolve_model(a.model)
    parts = a.parts.split(",")
    report: dict[str, Any] = {"benchmark": "encode", **header("cpu", x264_threads=video.X264_THREADS,
                                                                x264_base=video.X264_BASE),
                              "model": Path(model_dir).name}
    if "settings" in parts:
        clips = {}
        for kind in a.clips.split(","):
            clips[kind] = demo_clips(model_dir, a.demo_clips) if kind == "demo" else clip(kind, 49, 480, 832)
        report["clips"] = {k: list(v.shape) for k, v in clips.items()}
        crfs = [int(c) for c in a.crfs.split(",")]
        report["settings"] = settings_part(clips, 16, a.presets.split(","), crfs)
        print("equal quality:", report["settings"]["equal_quality"], flush=True)
    if "overlap" in parts:
        w, h, f = (int(x) for x in a.size.split("x"))
        report["overlap"] = overlap_part(model_dir, a.requests, a.reps, (w, h, f), a.steps)
        print({k: v for k, v in report["overlap"].items() if k != "runs"}, flush=True)
    out = a.out or RESULTS / f"{machine_kind(report, 'cpu')}-encode-bench-{dt.date.today().isoformat()}.json"
    print("wrote", write_report(report, out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
