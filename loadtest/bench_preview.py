"""What a preview costs next to a denoising step, on this machine (issue 36): the linear
latent-to-RGB projection the ranks use (models.preview) against a one-frame VAE decode.

Part 1, the demo model's real run: a request through ``PipelineRunner.frames`` with the
preview hook catching each step's latents; per step its wall time, and for those latents
the projection (on the pipeline thread: on the critical path), the WebP/PNG/JPEG encodes
(on the previewer's thread: off it) and a one-frame decode by the model's own VAE.
Part 2, at 480p (832x480x81: latents 16x21x60x104, random values; the times do not depend
on them): the projection and encodes, and a one-frame decode by a VAE of Wan2.1's shape
(diffusers' ``AutoencoderKLWan`` defaults, random weights).

    python loadtest/bench_preview.py --out loadtest/results/cpu-preview-DATE.json
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from reporting import header

from service.models import preview


def timed(fn: Callable[[], Any], reps: int) -> float:
    """Median seconds of ``reps`` calls (after one warm-up)."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def encodes(rgb: Any, reps: int) -> dict[str, dict[str, float]]:
    from PIL import Image

    def save(fmt: str, **kw: Any) -> bytes:
        b = io.BytesIO()
        Image.fromarray(rgb, "RGB").save(b, fmt, **kw)
        return b.getvalue()

    kinds = {"webp": lambda: preview.encode(rgb), "png": lambda: save("PNG"),
             "jpeg": lambda: save("JPEG", quality=80)}
    return {k: {"s": timed(f, reps), "bytes": len(f())} for k, f in kinds.items()}


def one_frame_decode(vae: Any, frame: torch.Tensor, reps: int) -> float:
    """Seconds of a decode of one latent frame (the first video frame), the fastest of
    ``reps`` (no separate warm-up: each takes seconds on a CPU)."""
    z = frame[:, :, :1].to(next(vae.parameters()).dtype)
    out = []
    with torch.no_grad():
        for _ in range(reps):
            t0 = time.perf_counter()
            vae.decode(z)
            out.append(time.perf_counter() - t0)
            print(f"  one-frame decode {tuple(z.shape)}: {out[-1]:.3f} s", flush=True)
    return min(out)


def part_demo(width: int, height: int, frames: int, steps: int, reps: int) -> dict[str, Any]:
    from service.models.demo import ensure_demo_model
    from service.models.pipeline import PipelineRunner
    from service.models.request import GenerationRequest

    runner = PipelineRunner.load(str(ensure_demo_model()), "cpu", config=None)
    req = GenerationRequest(prompt="a fox", seed=1, width=width, height=height, num_frames=frames,
                            num_inference_steps=steps)
    caught: list[torch.Tensor] = []
    marks: list[float] = []
    runner.adapter.latents_hook = lambda s, t, x: caught.append(x.clone())
    runner.frames(req)  # warm-up
    caught.clear()
    print("demo model warmed up", flush=True)
    t0 = time.perf_counter()
    runner.frames(req, lambda s, t: marks.append(time.perf_counter()))
    runner.adapter.latents_hook = None
    # Each step from the end of the one before (the first also holds the text encoding: left out).
    step_s = [b - a for a, b in zip([t0, *marks], marks, strict=False)][1:]
    x = caught[-1]
    project = timed(lambda: preview.project(preview.latent_frame(x, height, width)), reps)
    rgb = preview.project(preview.latent_frame(x, height, width)).numpy()
    vae = runner.adapter._parts["vae"]
    out = {"request": f"{width}x{height}x{frames}, {steps} steps", "latents": list(x.shape),
           "step_s_median": statistics.median(step_s), "project_s": project, "encode": encodes(rgb, reps),
           "vae_one_frame_decode_s": one_frame_decode(vae, x, 3)}
    print(json.dumps(out), flush=True)
    runner.close()
    return out


def part_480p(reps: int) -> dict[str, Any]:
    from diffusers import AutoencoderKLWan

    x = torch.randn(1, 16, 21, 60, 104)
    project = timed(lambda: preview.project(preview.latent_frame(x, 480, 832)), reps)
    rgb = preview.project(preview.latent_frame(x, 480, 832)).numpy()
    out = {"latents": list(x.shape), "project_s": project, "encode": encodes(rgb, reps)}
    print(json.dumps(out), flush=True)
    vae = AutoencoderKLWan().eval()  # Wan2.1's VAE shape
    out["wan21_vae_one_frame_decode_s"] = one_frame_decode(vae, x, 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="128x96x9", help="the demo request, WxHxF")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    w, h, f = (int(v) for v in a.size.split("x"))
    res: dict[str, Any] = {
        **header(threads=torch.get_num_threads()),
        "demo": part_demo(w, h, f, a.steps, a.reps),
        "p480": part_480p(a.reps),
    }
    d = res["demo"]
    d["project_of_step"] = d["project_s"] / d["step_s_median"]
    d["webp_of_step"] = d["encode"]["webp"]["s"] / d["step_s_median"]
    d["vae_of_step"] = d["vae_one_frame_decode_s"] / d["step_s_median"]
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
