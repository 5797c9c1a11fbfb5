"""MP4 encoding: x264 thread counts, preset/crf at equal quality, and encode beside decode
through a real rank. Writes JSON (command, machine, date) and prints tables.

Parts (``--parts``, default ``threads,settings,overlap``):

- ``threads``: the same clips (``noise``: what the random-weight presets give; ``smooth``: a
  panning low-frequency field, nearer a real video) encoded in this process with x264 frame
  threads and sliced threads at each ``--threads`` count, interleaved ``--reps`` times so a
  noisy host hurts all alike: wall and CPU seconds, the busiest thread, size, SHA-256 (one
  per configuration across reps, or the run says so). ``after`` is ``X264_THREADS``.
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
    python loadtest/bench_encode.py --parts threads,decode --threads 1,2,4,8,16 \\
        --device cuda --vae wan2.1 --out h200-encode-DATE.json       # a GPU host
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import statistics
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from clips import clip, frames_sha256
from reporting import header, write_report

from service.models import video

FPS = 16
X264_KEYS = ("threads", "lookahead_threads", "sliced_threads")


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process: x264's too
    return r.ru_utime + r.ru_stime


def _task_cpu() -> dict[int, float]:
    """CPU seconds of each thread of this process (/proc/self/task/*/stat: utime + stime)."""
    tck = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended between listdir and open
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tck
    return out


class BusiestThread:
    """The most CPU any one thread spent inside the ``with`` block (x264's threads come and
    go with the encoder, so they are sampled every 20 ms). An encode cannot finish faster
    than its busiest thread ran, so cpu_s / busiest is the most cores it could use: a
    speed-up bound that holds even on a host whose cores are all taken (this one)."""

    def __enter__(self) -> BusiestThread:
        self._base, self._seen = _task_cpu(), {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        me = threading.get_native_id()
        while True:
            for tid, c in _task_cpu().items():
                if tid != me:
                    self._seen[tid] = max(self._seen.get(tid, 0.0), c - self._base.get(tid, 0.0))
            if self._stop.wait(0.02):
                return

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.seconds = max(self._seen.values(), default=0.0)


def _encode(frames: np.ndarray, threads: int, sliced: bool) -> bytes:
    """``encode_mp4`` with sliced threads swapped in when asked (the service never slices)."""
    if not sliced:
        return video.encode_mp4(frames, FPS, threads=threads)
    base = video.x264_options

    def sliced_options(t: int = threads, b: dict[str, str] | None = None) -> dict[str, str]:
        o = base(t, b)
        return {**o, "x264-params": o["x264-params"].replace("sliced-threads=0", "sliced-threads=1")}

    video.x264_options = sliced_options  # type: ignore[assignment]
    try:
        return video.encode_mp4(frames, FPS, threads=threads)
    finally:
        video.x264_options = base  # type: ignore[assignment]


def convert_s(frames: np.ndarray) -> float:
    """RGB -> yuv420p on one thread, alone: the part of an encode that stays serial."""
    import av

    t0 = time.perf_counter()
    for arr in frames:
        av.VideoFrame.from_ndarray(arr, format="rgb24").reformat(format="yuv420p", threads=1)
    return time.perf_counter() - t0


def part_threads(args: argparse.Namespace, clips: dict[str, np.ndarray]) -> dict[str, Any]:
    counts = [int(t) for t in args.threads.split(",")]
    configs = [(kind, t, sliced) for kind in clips for sliced in (False, True) for t in counts
               if not (sliced and t == 1)]  # one thread: no slices to make
    runs: dict[tuple[str, int, bool], list[dict[str, Any]]] = {c: [] for c in configs}
    for rep in range(args.reps):
        for c in configs if rep % 2 == 0 else configs[::-1]:
            kind, t, sliced = c
            w0, c0 = time.perf_counter(), _cpu_s()
            with BusiestThread() as busiest:
                data = _encode(clips[kind], t, sliced)
            wall, cpu = time.perf_counter() - w0, _cpu_s() - c0
            s = video.x264_settings(data)
            runs[c].append({"wall_s": wall, "cpu_s": cpu, "busiest_thread_s": busiest.seconds,
                            "bytes": len(data),
                            "sha256": hashlib.sha256(data).hexdigest(),
                            "x264": {k: s.get(k) for k in X264_KEYS}})
            print(f"  rep {rep} {kind:6s} {'slice' if sliced else 'frame'} x{t:<2d} {wall:7.2f} s wall "
                  f"{cpu:7.2f} s cpu {busiest.seconds:7.2f} s busiest thread {len(data):9d} B", flush=True)
    rows = []
    for (kind, t, sliced), rs in runs.items():
        base = runs[(kind, 1, False)] if (kind, 1, False) in runs else rs
        med = statistics.median(r["wall_s"] for r in rs)
        busy = statistics.median(r["busiest_thread_s"] for r in rs)
        rows.append({"clip": kind, "threads": t, "kind": "slice" if sliced else "frame",
                     "median_wall_s": round(med, 3), "walls_s": [round(r["wall_s"], 3) for r in rs],
                     "median_cpu_s": round(statistics.median(r["cpu_s"] for r in rs), 3),
                     "median_busiest_thread_s": round(busy, 3),
                     "max_cores_used": round(statistics.median(r["cpu_s"] / max(r["busiest_thread_s"], 1e-3)
                                                               for r in rs), 2),
                     "x_one_thread": round(statistics.median(r["wall_s"] for r in base) / med, 3),
                     "bytes": rs[0]["bytes"], "distinct_sha256": len({r["sha256"] for r in rs}),
                     "sha256": rs[0]["sha256"], "x264": rs[0]["x264"],
                     "role": "before" if (t, sliced) == (1, False) else
                             "after" if (t, sliced) == (video.X264_THREADS, False) else ""})
    return {"rows": rows, "convert_s": {k: round(convert_s(f), 3) for k, f in clips.items()}}


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
    p.add_argument("--parts", default="threads,settings,overlap", help="threads,settings,overlap,decode")
    p.add_argument("--size", default="832x480x81", help="threads part: WIDTHxHEIGHTxFRAMES")
    p.add_argument("--clips", default="noise,smooth", help="threads part's clips")
    p.add_argument("--threads", default="1,2,4,8", help="x264 thread counts to compare")
    p.add_argument("--reps", type=int, default=2)
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
    p.add_argument("--decode-size", default=None, help="decode part's size (default --size)")
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
    if "threads" in parts:
        w, h, t = (int(v) for v in args.size.split("x"))
        clips = {k: clip(k, t, h, w) for k in args.clips.split(",") if k}
        res["size"], res["clips_sha256"] = args.size, {k: frames_sha256(f) for k, f in clips.items()}
        print("threads:", flush=True)
        res["threads"] = part_threads(args, clips)
        for r in res["threads"]["rows"]:
            print(f"  {r['clip']:6s} {r['kind']:5s} x{r['threads']:<2d} {r['median_wall_s']:7.2f} s "
                  f"({r['x_one_thread']:.2f}x one thread) cpu {r['median_cpu_s']:7.2f} s busiest thread "
                  f"{r['median_busiest_thread_s']:6.2f} s (<= {r['max_cores_used']:.2f} cores) "
                  f"{r['bytes']:9d} B sha {r['sha256'][:12]} ({r['distinct_sha256']} distinct) {r['role']}")
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
        dw, dh, dtn = (int(v) for v in (args.decode_size or args.size).split("x"))
        res["decode"] = part_decode(args, dw, dh, dtn)
    res["loadavg_end"] = os.getloadavg()
    if args.out:
        print("wrote", write_report(res, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
