"""MP4 encode time of a 480p x 81-frame clip: thread counts and kinds, and encoding while
the VAE still decodes. Writes JSON (command, machine, date) and prints tables.

Parts (``--parts``, default ``threads,stream``; both need only numpy + av + the repo):

- ``threads``: the same clips (``noise``: what the demo models' random weights give;
  ``smooth``: a panning low-frequency field, nearer a real video) encoded in this
  process with x264 frame threads and sliced threads at each ``--threads`` count, the
  configurations interleaved ``--reps`` times so a noisy host hurts all of them alike.
  Wall and CPU seconds, file size, SHA-256 (one per configuration across reps, or the
  run says so) and what x264 reports it ran with. ``before`` is 1 thread, the encoder's
  settings until issue 20 (the same bytes as that code); ``after`` is ``X264_THREADS``.
- ``stream``: could encoding start while the VAE decodes? An encoder process is fed the
  clip in the Wan VAE's causal chunks (1 frame, then 4 per latent frame) spread over a
  simulated decode of ``--decode-s`` seconds (the feeder sleeps, as a rank does while its
  GPU decodes), against decoding first and encoding after. Bytes must equal
  ``encode_mp4``'s. ``tail_s`` is what is left after the last chunk: x264 holds back its
  lookahead (40 frames at preset medium) until the end, so that part never overlaps.
- ``decode``: the same with a real Wan VAE decode on ``--device`` (needs torch and
  diffusers): ``--vae wan2.1`` builds Wan2.1's VAE shape (diffusers' defaults, random
  weights: the time does not depend on the values), ``demo`` the demo model's narrow one.
  Chunks come from a forward hook on the VAE's decoder; the frames must equal the whole
  decode's, the MP4 bytes must be equal.

    python loadtest/bench_encode.py --out loadtest/results/cpu-encode-DATE.json
    python loadtest/bench_encode.py --parts threads,stream,decode --threads 1,2,4,8,16 \\
        --device cuda --vae wan2.1 --out h200-encode-DATE.json       # a GPU host
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import resource
import statistics
import threading
import time
from pathlib import Path
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
    video.x264_options = lambda t=threads: {  # type: ignore[assignment]
        **base(t), "x264-params": base(t)["x264-params"].replace("sliced-threads=0", "sliced-threads=1")}
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


# -- streaming ----------------------------------------------------------------------------

def _stream_encoder(conn: Any, width: int, height: int, threads: int) -> None:
    """Child process: an Mp4Writer fed chunks from ``conn`` until None, then the bytes."""
    conn.send("ready")
    while True:
        writer = None
        while (msg := conn.recv()) is not None:
            if isinstance(msg, str) and msg == "exit":
                return
            if writer is None:
                writer = video.Mp4Writer(width, height, FPS, threads=threads)
            writer.add(msg)
        conn.send(writer.close() if writer else b"")


class StreamEncoder:
    """A spawned encoder process reused across runs (its start-up is not what we measure)."""

    def __init__(self, width: int, height: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_stream_encoder, args=(child, width, height, video.X264_THREADS))
        self.proc.start()
        assert self.conn.recv() == "ready"

    def send(self, frames: np.ndarray) -> None:
        self.conn.send(frames)

    def finish(self) -> bytes:
        self.conn.send(None)
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send("exit")
        self.proc.join(timeout=30)


def wan_chunks(t: int) -> list[slice]:
    """The frames each Wan VAE decoder call yields: 1, then 4 per further latent frame."""
    out, start = [slice(0, 1)], 1
    while start < t:
        out.append(slice(start, min(start + 4, t)))
        start += 4
    return out


def held_back(frames: np.ndarray) -> int:
    """Frames x264 gives out only when the input ends (its lookahead and frame threads):
    the part of an encode that cannot overlap a decode, however slowly frames arrive."""
    w = video.Mp4Writer(frames.shape[2], frames.shape[1], FPS)
    try:
        w.add(frames)
        return w.frames - w.finished
    finally:
        w.abort()


def part_stream(args: argparse.Namespace, clips: dict[str, np.ndarray]) -> dict[str, Any]:
    rows = []
    for kind, frames in clips.items():
        held = held_back(frames)
        print(f"  {kind:6s}: x264 holds back {held} of {len(frames)} frames until the input ends", flush=True)
        want = video.encode_mp4(frames, FPS)
        enc = StreamEncoder(frames.shape[2], frames.shape[1])
        try:
            for decode_s in [float(d) for d in args.decode_s.split(",")]:
                seq, streamed, tails, ok = [], [], [], True
                for _ in range(args.stream_reps):
                    # Sequential: the whole decode, then the whole clip to the encoder.
                    t0 = time.perf_counter()
                    time.sleep(decode_s)
                    enc.send(frames)
                    ok &= enc.finish() == want
                    seq.append(time.perf_counter() - t0)
                    # Streamed: each chunk as the decode makes it.
                    chunks = wan_chunks(len(frames))
                    t0 = time.perf_counter()
                    for i, sl in enumerate(chunks):
                        time.sleep(max(0.0, t0 + decode_s * (i + 1) / len(chunks) - time.perf_counter()))
                        enc.send(frames[sl])
                    t_last = time.perf_counter()
                    ok &= enc.finish() == want
                    streamed.append(time.perf_counter() - t0)
                    tails.append(time.perf_counter() - t_last)
                s, st = statistics.median(seq), statistics.median(streamed)
                rows.append({"clip": kind, "held_back_frames": held, "frames": len(frames),
                             "decode_s": decode_s, "sequential_s": round(s, 3),
                             "streamed_s": round(st, 3), "saved_s": round(s - st, 3),
                             "tail_after_last_chunk_s": round(statistics.median(tails), 3),
                             "bytes_equal": ok})
                print(f"  {kind:6s} decode {decode_s:5.1f} s: sequential {s:6.2f} s, streamed {st:6.2f} s, "
                      f"tail {rows[-1]['tail_after_last_chunk_s']:.2f} s, bytes equal {ok}", flush=True)
        finally:
            enc.close()
    return {"rows": rows, "threads": video.X264_THREADS}


def _vae(name: str, device: str) -> Any:
    from diffusers import AutoencoderKLWan

    if name == "wan2.1":
        vae = AutoencoderKLWan()  # diffusers' defaults are Wan2.1's VAE (base_dim 96)
    elif name == "demo":
        from service.models.demo import ensure_demo_model

        vae = AutoencoderKLWan.from_pretrained(ensure_demo_model("tiny"), subfolder="vae")
    else:
        vae = AutoencoderKLWan.from_pretrained(name, subfolder="vae")
    return vae.to(device=device).float().eval()


def _to_uint8(x: Any) -> np.ndarray:
    """Decoder output [1, 3, t, H, W] in [-1, 1] -> uint8 [t, H, W, 3], as the pipeline does."""
    from service.models.adapter import frames_to_uint8

    x = (x.clamp(-1.0, 1.0) * 0.5 + 0.5).clamp(0.0, 1.0)  # VAE clamp, then VideoProcessor's denormalize
    return frames_to_uint8(x[0].permute(1, 0, 2, 3))


def part_decode(args: argparse.Namespace, width: int, height: int, frames_n: int) -> dict[str, Any]:
    import torch

    dev = torch.device(args.device)
    vae = _vae(args.vae, args.device)
    lat_t = (frames_n - 1) // 4 + 1
    z = torch.randn(1, 16, lat_t, height // 8, width // 8, generator=torch.Generator().manual_seed(0)).to(dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def decode(on_chunk: Any = None) -> np.ndarray:
        handle = None
        if on_chunk is not None:
            def hook(_module: Any, _args: Any, out: Any) -> None:  # None: the output stays as it is
                on_chunk(_to_uint8(out))

            handle = vae.decoder.register_forward_hook(hook)
        try:
            with torch.inference_mode():
                out = vae.decode(z).sample
            sync()
            return _to_uint8(out)
        finally:
            if handle is not None:
                handle.remove()

    decode()  # warm-up: CUDA kernels and the allocator; oneDNN's primitives on a CPU
    t0 = time.perf_counter()
    frames = decode()
    decode_alone = time.perf_counter() - t0
    want = video.encode_mp4(frames, FPS)
    enc = StreamEncoder(width, height)
    try:
        t0 = time.perf_counter()
        enc.send(decode())
        ok_seq = enc.finish() == want
        sequential = time.perf_counter() - t0
        got: list[np.ndarray] = []
        t0 = time.perf_counter()

        def take(f: np.ndarray) -> None:
            got.append(f)
            enc.send(f)

        decode(take)
        t_last = time.perf_counter()
        ok_stream = enc.finish() == want
        streamed = time.perf_counter() - t0
        tail = time.perf_counter() - t_last
    finally:
        enc.close()
    same_frames = np.array_equal(np.concatenate(got), frames)
    row = {"vae": args.vae, "device": args.device, "size": f"{width}x{height}x{frames_n}",
           "decode_s": round(decode_alone, 3), "sequential_s": round(sequential, 3),
           "streamed_s": round(streamed, 3), "saved_s": round(sequential - streamed, 3),
           "tail_after_last_chunk_s": round(tail, 3), "chunks": len(got),
           "frames_equal": same_frames, "bytes_equal": ok_seq and ok_stream,
           "frames_sha256": frames_sha256(frames)}
    print(f"  decode {row['decode_s']} s, sequential {row['sequential_s']} s, "
          f"streamed {row['streamed_s']} s, frames equal {same_frames}, bytes equal {row['bytes_equal']}",
          flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="threads,stream", help="threads,stream,decode")
    p.add_argument("--size", default="832x480x81", help="WIDTHxHEIGHTxFRAMES")
    p.add_argument("--clips", default="noise,smooth")
    p.add_argument("--threads", default="1,2,4,8", help="x264 thread counts to compare")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--decode-s", default="0,2,5", help="simulated decode times for the stream part")
    p.add_argument("--stream-reps", type=int, default=1)
    p.add_argument("--device", default="cpu", help="for the decode part")
    p.add_argument("--vae", default="demo", help="decode part: wan2.1 | demo | a model folder")
    p.add_argument("--decode-size", default=None, help="decode part's size (default --size)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    w, h, t = (int(v) for v in args.size.split("x"))
    parts = [x for x in args.parts.split(",") if x]
    clips = {k: clip(k, t, h, w) for k in args.clips.split(",") if k}
    import av

    res: dict[str, Any] = {**header(args.device, numpy=np.__version__, av=av.__version__,
                                    x264_params=video.x264_options()["x264-params"]),
                           "size": args.size, "fps": FPS,
                           "x264_threads": video.X264_THREADS,
                           "clips_sha256": {k: frames_sha256(f) for k, f in clips.items()}}
    if "threads" in parts:
        print("threads:", flush=True)
        res["threads"] = part_threads(args, clips)
        for r in res["threads"]["rows"]:
            print(f"  {r['clip']:6s} {r['kind']:5s} x{r['threads']:<2d} {r['median_wall_s']:7.2f} s "
                  f"({r['x_one_thread']:.2f}x one thread) cpu {r['median_cpu_s']:7.2f} s busiest thread "
                  f"{r['median_busiest_thread_s']:6.2f} s (<= {r['max_cores_used']:.2f} cores) "
                  f"{r['bytes']:9d} B "
                  f"sha {r['sha256'][:12]} ({r['distinct_sha256']} distinct) {r['role']}")
    if "stream" in parts:
        print("stream:", flush=True)
        res["stream"] = part_stream(args, clips)
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
