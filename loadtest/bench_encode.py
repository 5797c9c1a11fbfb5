"""MP4 encoding: x264 preset/crf at equal quality, and encode beside decode through a real
rank and beside a real VAE decode. Writes JSON (command, machine, date) and prints tables.
(The x264 thread-count part that chose ``X264_THREADS`` is recorded in results/
``*-encode-threads-*``/``h200-encode-2026-12-01.json``; docs/benchmarks.md, "Removed experiments".)

Parts (``--parts``, default ``settings,overlap``):

- ``settings``: clips at each ``--presets`` x ``--crfs`` with ``X264_THREADS`` threads: CPU
  seconds, bytes, PSNR (dB, RGB, the decoded MP4 against the frames given); the ``demo`` clip
  is the trained demo model's own clips at its default request, end to end. For each preset,
  ``equal_quality`` names the highest crf whose PSNR is at least the default's (``X264_BASE``)
  on every clip; ``more_threads`` says whether the default at 2x the threads keeps the bytes
  (it does not, so "the free cores" cannot go to the last clip in flight).
- ``overlap``: the same requests through one real rank (``RankWorker``, the trained demo
  model, one encoder process) with decoded chunks streamed to the encoder (``overlap``) and
  with the whole clip handed over after the decode (``after``, the code before issue 49),
  interleaved ``--reps`` times: seconds from the first assign to the last MP4, the tail after
  the last forward, and the MP4 digests (they must be equal).
- ``decode``: a real Wan VAE decode on ``--device`` (``service.models.decode``, chunk by
  chunk) streamed into the service's encoder against decode-then-encode: ``--vae wan2.1``
  builds Wan2.1's VAE shape (random weights: the time does not depend on the values).

    OMP_NUM_THREADS=1 python loadtest/bench_encode.py --out loadtest/results/cpu-encode-DATE.json
    python loadtest/bench_encode.py --parts decode --device cuda --vae wan2.1 \\
        --decode-size 832x480x49 --out h200-encode-DATE.json       # a GPU host
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from clips import clip, frames_sha256
from reporting import frame_psnr, header, write_report

from service.models import video

FPS = 16


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
            "psnr_db": round(frame_psnr(video.decode_mp4(data), frames), 3),
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


def _vae(name: str, device: str) -> Any:
    from diffusers import AutoencoderKLWan

    if name == "wan2.1":
        vae = AutoencoderKLWan()  # diffusers' defaults are Wan2.1's VAE (base_dim 96)
    else:
        from service.models.registry import resolve_model

        folder = resolve_model(None if name == "demo" else name)
        vae = AutoencoderKLWan.from_pretrained(folder, subfolder="vae")
    return vae.to(device=device).float().eval()


def _encode_clip(stream_chunks: Any, overlap: bool) -> tuple[bytes, float]:
    """Run ``stream_chunks(add)`` into a fresh encoder process's stream; the MP4 and the
    seconds from the first chunk's request to the bytes."""
    from service.engine.encoder import Encoder

    enc = Encoder(1, overlap=overlap)
    enc.wait_warm()
    got: dict[str, Any] = {}
    done = threading.Event()

    def finish(data: bytes | None, error: str | None) -> None:
        got.update(data=data, error=error)
        done.set()

    try:
        t0 = time.perf_counter()
        stream = enc.open(FPS, finish)
        stream_chunks(stream.add)
        stream.close()
        done.wait()
        seconds = time.perf_counter() - t0
    finally:
        enc.close()
    if got["error"]:
        raise RuntimeError(got["error"])
    return got["data"], seconds


def part_decode(args: argparse.Namespace, width: int, height: int, frames_n: int) -> dict[str, Any]:
    """The service's chunked decode (models/decode.py) into its encoder, streamed or not."""
    import torch
    from diffusers.video_processor import VideoProcessor

    from service.models.decode import decode_frames

    dev = torch.device(args.device)
    vae = _vae(args.vae, args.device)
    processor = VideoProcessor(vae_scale_factor=vae.spatial_compression_ratio)
    pipe = SimpleNamespace(vae=vae, video_processor=processor)
    lat_t = (frames_n - 1) // 4 + 1
    ch, f = vae.config.z_dim, vae.spatial_compression_ratio
    z = torch.randn(1, ch, lat_t, height // f, width // f, generator=torch.Generator().manual_seed(0)).to(dev)

    def decode(add: Any) -> None:
        with torch.inference_mode():
            decode_frames(pipe, z, add)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    chunks: list[np.ndarray] = []
    decode(chunks.append)  # warm-up: CUDA kernels and the allocator; oneDNN's primitives on a CPU
    frames = np.concatenate(chunks)
    t0 = time.perf_counter()
    decode(lambda _f: None)
    decode_alone = time.perf_counter() - t0
    want = video.encode_mp4(frames, FPS)
    after, sequential = _encode_clip(decode, overlap=False)
    streamed_mp4, streamed = _encode_clip(decode, overlap=True)
    row = {"vae": args.vae, "device": args.device, "size": f"{width}x{height}x{frames_n}",
           "decode_s": round(decode_alone, 3), "sequential_s": round(sequential, 3),
           "streamed_s": round(streamed, 3), "saved_s": round(sequential - streamed, 3),
           "chunks": len(chunks), "bytes_equal": after == want == streamed_mp4,
           "frames_sha256": frames_sha256(frames)}
    print(f"  decode {row['decode_s']} s, decode then encode {row['sequential_s']} s, "
          f"streamed {row['streamed_s']} s, bytes equal {row['bytes_equal']}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="settings,overlap", help="settings,overlap,decode")
    p.add_argument("--reps", type=int, default=2, help="overlap part")
    p.add_argument("--settings-clips", default="demo,smooth")
    p.add_argument("--presets", default="ultrafast,superfast,veryfast,faster,fast,medium")
    p.add_argument("--crfs", default="12,14,16,18")
    p.add_argument("--demo-clips", type=int, default=3)
    p.add_argument("--requests", type=int, default=6, help="overlap part")
    p.add_argument("--request-size", default="256x256x33", help="overlap part: WxHxF of each request")
    p.add_argument("--steps", type=int, default=2, help="overlap part")
    p.add_argument("--model", default=None, help="default: the trained demo model")
    p.add_argument("--device", default="cpu", help="decode part")
    p.add_argument("--vae", default="demo", help="decode part: wan2.1 | demo | a model folder")
    p.add_argument("--decode-size", default="832x480x49", help="decode part: WIDTHxHEIGHTxFRAMES")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import av

    from service.models.registry import resolve_model

    parts = [x for x in args.parts.split(",") if x]
    model_dir = resolve_model(args.model)
    res: dict[str, Any] = {**header(args.device, numpy=np.__version__, av=av.__version__,
                                    x264_params=video.x264_options()["x264-params"]),
                           "x264_threads": video.X264_THREADS, "x264_base": video.X264_BASE,
                           "fps": FPS, "model": Path(model_dir).name}
    if "settings" in parts:
        sclips = {k: demo_clips(model_dir, args.demo_clips) if k == "demo" else clip(k, 49, 480, 832)
                  for k in args.settings_clips.split(",") if k}
        res["settings_clips"] = {k: list(v.shape) for k, v in sclips.items()}
        res["settings"] = settings_part(sclips, FPS, args.presets.split(","),
                                        [int(c) for c in args.crfs.split(",")])
        print("equal quality:", res["settings"]["equal_quality"], flush=True)
    if "overlap" in parts:
        w, h, f = (int(x) for x in args.request_size.split("x"))
        res["overlap"] = overlap_part(model_dir, args.requests, args.reps, (w, h, f), args.steps)
        print({k: v for k, v in res["overlap"].items() if k != "runs"}, flush=True)
    if "decode" in parts:
        print("decode:", flush=True)
        dw, dh, dtn = (int(v) for v in args.decode_size.split("x"))
        res["decode"] = part_decode(args, dw, dh, dtn)
    res["loadavg_end"] = os.getloadavg()
    if args.out:
        print("wrote", write_report(res, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
