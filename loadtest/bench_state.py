"""What keeping a request's per-step state costs a rank (engine/state.py), in two parts.

``tap``: the hand-off alone, on a latent of ``--shape`` and the loop state of each of
``--schedulers`` at that shape (models/loop.py: "none", "euler", "unipc" after two steps,
what a Wan request keeps): the pipeline thread's time in
``StateTap.take`` per step (it runs between two forwards, where the tick thread waits), the
time until the state is on the host (``landed_ms``: a GPU copy lands on a side stream), the
pickle that carries it to the driver (off that thread), and the write that keeps it in the
results folder for a restart (``store_ms``: ``<id>.state`` through ResultStorage, off the
dispatcher thread, at most every ``STATE_EVERY_S`` per job; api/durable.py).

``steps`` (with ``--model``): a real request (default 832x480x81, CFG) through
``PipelineRunner`` with DLO AllGather at DP1, run alternately without and with the state
kept, the same bytes expected: the time of steps 2 .. n on the compute stream (CUDA events
at each step's end; host time on CPU) with the state kept against without (its median
difference is the cost per step), and the tap's own numbers in place. The model runs with its
own scheduler (the demo presets' and Wan's UniPC), or ``--euler`` with a flow-matching Euler one.

``sizes``: one small request on each demo family (``--families``: explicit presets, with a
step cache where named, e.g. ``tiny+first_block``), the state it keeps after a step split
into latents, scheduler, step cache and generator, as bytes and as latents' multiples, and
its state file's write time.

    python loadtest/bench_state.py --reps 50 --out loadtest/results/cpu-state-cost.json
    python loadtest/bench_state.py --parts tap,sizes --reps 20 --out loadtest/results/cpu-state-loop.json
    python loadtest/bench_state.py --device cuda --model /tmp/wan12 --out $OUT/h200-state.json
        # /tmp/wan12: dloserve demo-model /tmp/wan12 --preset wan14b-shape --layers 12

The default shape is a 480p x 81 Wan latent (16 channels, 21 latent frames, 60 x 104).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import statistics
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from reporting import header

from service.api.durable import state_bytes
from service.api.results import ResultStorage
from service.engine.state import StateTap

PARTS = ("tap", "steps", "sizes")
FAMILIES = ("tiny", "tiny+first_block", "tiny+mag", "euler", "wan22-t2v-tiny", "wan-i2v-tiny")
MAG_RATIOS = (1.0, 0.99, 0.98, 0.97)  # for the 4-step requests of ``sizes``


def median_ms(xs: list[float]) -> float | None:
    return round(1000 * statistics.median(xs), 3) if xs else None


def scheduler_loop(name: str, latents: torch.Tensor) -> dict[str, Any] | None:
    """The loop state a Wan request on scheduler ``name`` keeps after its second step, at
    ``latents``' shape and place (None for "none": the latents alone)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    from service.models import loop

    if name == "none":
        return None
    s = (UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
         if name == "unipc" else FlowMatchEulerDiscreteScheduler(shift=3.0))
    s.set_timesteps(8, device=latents.device)
    x = latents.float()
    for t in s.timesteps[:2]:
        x = s.step(torch.randn_like(x), t, x, return_dict=False)[0]
    return {"scheduler": loop.scheduler_state(s), "hooks": {}, "generator": torch.Generator().get_state()}


def measure(shape: tuple[int, ...], dtype: torch.dtype, device: str, reps: int,
            storage: ResultStorage, scheduler: str = "none") -> dict:
    """The tap alone on one latent and ``scheduler``'s loop state, ``reps`` times after 3
    warm-up rounds."""
    latents = torch.randn(shape, dtype=torch.float32).to(device, dtype)
    loop_state = scheduler_loop(scheduler, latents)
    tap = StateTap()
    take, landed, pickled, stored, size, state_size, file_size = [], [], [], [], 0, 0, 0
    for _ in range(reps + 3):  # the first few warm the allocator and the stream
        got = threading.Event()
        box: list = []
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        tap.take(1, 2, latents, loop_state, lambda st, box=box, got=got: (box.append(st), got.set()))
        t1 = time.perf_counter()
        got.wait()
        t2 = time.perf_counter()
        blob = pickle.dumps(box[0], protocol=5)
        t3 = time.perf_counter()
        data = state_bytes(box[0])
        storage.put_bytes("video_bench.state", data)
        stored.append(time.perf_counter() - t3)
        size, state_size, file_size = len(blob), box[0].nbytes, len(data)
        take.append(t1 - t0)
        landed.append(t2 - t0)
        pickled.append(t3 - t2)
    tap.close()
    return {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "device": device,
            "scheduler": scheduler, "bytes": latents.numel() * latents.element_size(),
            "state_bytes": state_size, "file_bytes": file_size, "pickled_bytes": size,
            "take_ms_median": median_ms(take[3:]), "landed_ms_median": median_ms(landed[3:]),
            "pickle_ms_median": median_ms(pickled[3:]), "store_ms_median": median_ms(stored[3:]),
            "take_ms_max": round(1000 * max(take[3:]), 3)}


def run_once(runner: Any, req: Any, dev: torch.device, tap: StateTap | None) -> dict[str, Any]:
    """One request; with ``tap`` (one per rank, as in the service) every step but the last
    hands its latents to it."""
    ends: list[Any] = []  # each step's end: a CUDA event on the compute stream, or a host time
    landed: list[float] = []
    took: list[float] = []  # the pipeline thread's time in each take

    def on_step(done: int, total: int) -> None:
        if dev.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            ends.append(ev)
        else:
            ends.append(time.perf_counter())

    def on_latents(step: int, total: int, latents: torch.Tensor, loop: dict[str, Any]) -> None:
        t = time.perf_counter()
        tap.take(step, total, latents, loop, lambda st, t=t: landed.append(time.perf_counter() - t))
        took.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    frames = runner.frames(req, on_step, on_latents if tap else None)  # returns synchronized
    seconds = time.perf_counter() - t0
    end = time.monotonic() + 60
    while len(landed) < len(took) and time.monotonic() < end:  # the tap's thread emits the last
        time.sleep(0.001)
    if dev.type == "cuda":
        gaps = [a.elapsed_time(b) / 1000 for a, b in zip(ends, ends[1:], strict=False)]
    else:
        gaps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    # steps 2 .. n, each from the previous one's end (step 1's includes the text encoder). A
    # state is taken at the end of steps 1 .. n-1: on CPU its copy is in the step it ends, on
    # a GPU its copy runs on a side stream beside the next step's compute
    return {"keep": tap is not None, "seconds": round(seconds, 3), "states": len(took),
            "step_ms": [round(1000 * g, 2) for g in gaps],
            "take_ms_median": median_ms(took),
            "landed_ms_median": median_ms(landed), "sha256": hashlib.sha256(frames.tobytes()).hexdigest(),
            "take_s": took, "landed_s": landed}


def steps(args: argparse.Namespace) -> dict[str, Any]:
    """The real request alternately without and with the state kept (after a warm-up)."""
    from service.config import EngineConfig, ModelConfig, OffloadConfig, OffloadMode
    from service.models.demo.euler import euler_view
    from service.models.pipeline import PipelineRunner
    from service.models.request import GenerationRequest

    if args.steps < 3:
        raise SystemExit("--steps: at least 3 (the first step's time has no start, the last keeps no state)")
    dev = torch.device(args.device)
    w, h, f = (int(v) for v in args.size.split("x"))
    req = GenerationRequest(prompt="a red fox running through snow", seed=7, width=w, height=h, num_frames=f,
                            num_inference_steps=args.steps, guidance_scale=5.0)
    config = EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER), model=ModelConfig(dtype=args.dtype))
    with tempfile.TemporaryDirectory() as tmp:
        model = euler_view(args.model, Path(tmp) / "euler") if args.euler else Path(args.model)
        t0 = time.perf_counter()
        runner = PipelineRunner.load(str(model), dev, config=config)
        load_s = time.perf_counter() - t0
        tap = StateTap()
        try:
            if not runner.resumable(req):
                raise SystemExit(f"{args.model}: not resumable here: {runner.resume_blocker(req)}")
            run_once(runner, replace(req, num_inference_steps=3), dev, tap)  # warm-up: kernels, allocator
            runs = [run_once(runner, req, dev, t) for _ in range(args.rounds) for t in (None, tap)]
        finally:
            tap.close()
            runner.close()
    off = [ms for r in runs if not r["keep"] for ms in r["step_ms"]]
    on = [ms for r in runs if r["keep"] for ms in r["step_ms"]]
    med_off, med_on = statistics.median(off), statistics.median(on)
    took = [t for r in runs for t in r.pop("take_s")]  # every take and landing, over the runs
    landed = [t for r in runs for t in r.pop("landed_s")]
    kept = [r for r in runs if r["keep"]]
    return {"model": args.model, "scheduler": "euler" if args.euler else "the model's",
            "size": args.size, "steps": args.steps, "rounds": args.rounds,
            "tokens": ((f - 1) // 4 + 1) * (h // 16) * (w // 16), "load_s": round(load_s, 1),
            "summary": {
                "step_ms_median_without": round(med_off, 2), "step_ms_median_with": round(med_on, 2),
                "step_cost_ms": round(med_on - med_off, 2),
                "step_cost_pct": round(100 * (med_on - med_off) / med_off, 3),
                "take_ms_median": median_ms(took), "landed_ms_median": median_ms(landed),
                "states_per_run": kept[0]["states"],
                "bytes_equal": len({r["sha256"] for r in runs}) == 1},
            "runs": runs}


def _tensor_bytes(tree: Any, seen: set[int]) -> int:
    if isinstance(tree, torch.Tensor):
        if id(tree) in seen:
            return 0
        seen.add(id(tree))
        return tree.numel() * tree.element_size()
    if isinstance(tree, list | tuple):
        return sum(_tensor_bytes(v, seen) for v in tree)
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v, seen) for v in tree.values())
    return 0


def _png() -> bytes:
    """A seeded 56x40 RGB PNG: the I2V families' image."""
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(7).random((40, 56, 3)) * 255).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def sizes(args: argparse.Namespace, storage: ResultStorage) -> list[dict[str, Any]]:
    """The state one small request per family keeps after its second step, part by part."""
    from service.config.cache import CacheSpec
    from service.models.demo import ensure_demo_model
    from service.models.demo.euler import euler_view
    from service.models.pipeline import PipelineRunner
    from service.models.request import GenerationRequest
    from service.models.resume import StepState

    w, h, f = (int(v) for v in args.sizes_size.split("x"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            preset, _, cache = family.partition("+")
            spec = None
            if cache:
                spec = CacheSpec(cache, threshold=0.5, max_skip_steps=2, retention_ratio=0.2,
                                 mag_ratios=MAG_RATIOS) if cache == "mag" else CacheSpec(cache, threshold=0.2)
            model = (euler_view(ensure_demo_model("tiny"), Path(tmp) / "euler") if preset == "euler"
                     else ensure_demo_model(preset))
            image = _png() if "i2v" in preset else None
            req = GenerationRequest(prompt="a fox", seed=3, width=w, height=h, num_frames=f,
                                    num_inference_steps=4, cache=spec, image=image)
            runner = PipelineRunner.load(str(model), "cpu", config=None)
            kept: list[tuple[StepState, dict[str, int]]] = []

            def on_latents(step: int, total: int, latents: torch.Tensor, loop: dict[str, Any],
                           kept: list = kept) -> None:
                if step == 2:
                    parts = {k: _tensor_bytes(v, set()) for k, v in loop.items()}
                    kept.append((StepState.of(step, total, latents, loop), parts))

            try:
                runner.frames(req, on_latents=on_latents)
                scheduler = type(runner.adapter._scheduler(req)).__name__
            finally:
                runner.close()
            st, parts = kept[0]
            t0 = time.perf_counter()
            data = state_bytes(st)
            storage.put_bytes("video_sizes.state", data)
            latent = int(st.data.nbytes)
            rows.append({"family": family, "scheduler": scheduler, "size": args.sizes_size,
                         "latents_bytes": latent, "state_bytes": st.nbytes, "file_bytes": len(data),
                         "parts_bytes": parts, "latents_multiple": round(st.nbytes / latent, 2),
                         "write_ms": round(1000 * (time.perf_counter() - t0), 3)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=None, help=f"comma-separated of {PARTS} (default: tap, and steps "
                    "with --model)")
    ap.add_argument("--shape", default="1,16,21,60,104", help="tap: the latent's shape")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="tap: the latent's dtypes")
    ap.add_argument("--schedulers", default="none,euler,unipc", help="tap: whose loop state goes with it")
    ap.add_argument("--families", default=",".join(FAMILIES), help="sizes: demo presets (+cache)")
    ap.add_argument("--sizes-size", default="64x64x9", help="sizes: WIDTHxHEIGHTxFRAMES of their request")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--reps", type=int, default=50, help="tap: hand-offs timed")
    ap.add_argument("--results-url", help="tap: where the state files go (default: a temporary folder)")
    ap.add_argument("--model", help="steps: a Wan pipeline folder")
    ap.add_argument("--euler", action="store_true", help="steps: its scheduler swapped for Euler")
    ap.add_argument("--size", default="832x480x81", help="steps: WIDTHxHEIGHTxFRAMES")
    ap.add_argument("--steps", type=int, default=4, help="steps: per request (states: steps - 1)")
    ap.add_argument("--rounds", type=int, default=2, help="steps: pairs of runs (without, with)")
    ap.add_argument("--dtype", default=None, help="steps: the transformer's dtype (default: the "
                    "checkpoint's)")
    ap.add_argument("--out")
    a = ap.parse_args()
    parts = (a.parts or ("tap,steps" if a.model else "tap")).split(",")
    if bad := [p for p in parts if p not in PARTS]:
        ap.error(f"--parts: {bad} not in {PARTS}")
    if "steps" in parts and not a.model:
        ap.error("--parts steps needs --model")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    out: dict[str, Any] = header(a.device)
    if "tap" in parts:
        shape = tuple(int(x) for x in a.shape.split(","))
        with tempfile.TemporaryDirectory() as tmp:
            storage = ResultStorage(a.results_url or tmp)
            out["reps"] = a.reps
            out["runs"] = [measure(shape, getattr(torch, d), a.device, a.reps, storage, sched)
                           for d in a.dtypes.split(",") for sched in a.schedulers.split(",")]
    if "steps" in parts:
        out["steps"] = steps(a)
    if "sizes" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            out["sizes"] = sizes(a, ResultStorage(a.results_url or tmp))
    text = json.dumps(out, indent=2)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
