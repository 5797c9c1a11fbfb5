"""What FP8 weights cost in accuracy and save in bytes, on CPU (the figures issue 23 asks for).

Three parts, all in this process, written to one JSON (default
``loadtest/results/cpu-fp8-<date>.json``):

- ``transformer``: one forward of the Wan2.1-14B block shapes (``--layers`` of them: 40 is
  the GPU run's job, ``loadtest/bench_fp8.py``) and of the ``small`` preset served in bf16:
  relative L2 error of FP8 (upcast and scaled_mm) against bf16 resident, and whether FP8
  DLO (AllGather DP1) equals FP8 resident bit for bit.
- ``frames``: one request through the demo pipelines (``tiny`` and ``small``), FP8 against
  the unquantized pipeline in the same serving dtype: PSNR of the decoded uint8 frames. The
  demo weights are noise: the PSNR says how far fp8 moves the output, not how a video looks.
- ``bytes``: per-block bytes by dtype (bf16 vs fp8) for the 14B shapes, and what 40 such
  blocks cost in host shards at DP1/DP2.

    python loadtest/fp8_error.py                       # ~10 min on 2 busy cores
    python loadtest/fp8_error.py --layers 1 --tokens 64 --sizes 32x32x5 --out /tmp/e.json  # quick
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from offload_strategies import _keep_fp32, _meta_transformer
from reporting import header

from service.config import EngineConfig, ModelConfig, OffloadConfig, OffloadMode
from service.config.offload import parse_probe_size
from service.models.demo import ensure_demo_model, write_demo_model
from service.offload import enable_layerwise_offload, load_resident
from service.offload.quant import set_compute

LATENTS = {64: (1, 16, 16), 256: (1, 32, 32), 1024: (1, 64, 64)}  # tokens -> latent (f, h, w)
COMPUTES = ("upcast", "scaled_mm")
CPU = torch.device("cpu")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _inputs(folder: Path, tokens: int, dtype: torch.dtype) -> dict[str, Any]:
    cfg = json.loads((folder / "config.json").read_text())
    g = torch.Generator().manual_seed(tokens)
    return {"hidden_states": torch.randn(1, 16, *LATENTS[tokens], generator=g).to(dtype),
            "timestep": torch.tensor([500]),
            "encoder_hidden_states": torch.randn(1, 512, cfg["text_dim"], generator=g).to(dtype),
            "return_dict": False}


def transformer_error(model: str, tokens: int, dtype: torch.dtype | None) -> dict[str, Any]:
    """One forward: bf16 resident vs FP8 resident (each compute) vs FP8 DLO (bitwise)."""
    folder = Path(model) / "transformer"
    keep = _keep_fp32() if dtype is not None else ()
    x_dtype = dtype or torch.bfloat16
    x = _inputs(folder, tokens, x_dtype)
    out: dict[str, Any] = {"model": model, "tokens": tokens, "serving_dtype": str(x_dtype)}
    with torch.inference_mode():
        ref_module = load_resident(_meta_transformer(folder), folder, CPU, dtype=dtype, keep_fp32=keep)
        t0 = time.perf_counter()
        ref = ref_module(**x)[0]
        out["bf16_forward_s"] = time.perf_counter() - t0
        del ref_module
        t0 = time.perf_counter()
        fp8 = load_resident(_meta_transformer(folder), folder, CPU, dtype=dtype, keep_fp32=keep,
                            quantization="fp8", block_attrs=["blocks"])
        out["fp8_load_s"] = time.perf_counter() - t0  # quantizes every block Linear once
        got = {}
        for compute in COMPUTES:
            set_compute(fp8, compute, CPU)
            t0 = time.perf_counter()
            got[compute] = fp8(**x)[0]
            out[compute] = {"rel_error_vs_bf16": rel(got[compute], ref),
                            "forward_s": time.perf_counter() - t0}
        del fp8
        module = _meta_transformer(folder)
        h = enable_layerwise_offload(module, folder, device=CPU, block_attrs=["blocks"], dtype=dtype,
                                     keep_fp32=keep, quantization="fp8")
        dlo = module(**x)[0]
        out["upcast"]["dlo_bitwise_equal_resident"] = torch.equal(dlo, got["upcast"])
        out["block_bytes_by_dtype"] = h.stats().block_bytes_by_dtype
        h.close()
    return out


def block_bytes(model: str) -> dict[str, Any]:
    """Bytes of one 14B-shaped block as bf16 and as fp8 (from the layouts), and 40 of them."""
    folder = Path(model) / "transformer"
    res = {}
    for name, q in (("bf16", None), ("fp8", "fp8")):
        h = enable_layerwise_offload(_meta_transformer(folder), folder, device=CPU, block_attrs=["blocks"],
                                     mode=OffloadMode.RANK_LOCAL, quantization=q)
        lay = h.layouts[0]
        res[name] = {"block_bytes": lay.total_bytes, "40_blocks_gb": 40 * lay.total_bytes / 1e9,
                     "by_dtype": {str(k): v for k, v in lay.dtype_bytes.items()},
                     "host_shards_dp2_gb_per_rank": 40 * lay.shard_bytes(2) / 1e9}
        h.close()
    res["fp8_over_bf16"] = res["fp8"]["block_bytes"] / res["bf16"]["block_bytes"]
    return res


def frames_psnr(preset: str, size: list[int], steps: int) -> dict[str, Any]:
    """One request through the demo pipeline: FP8 vs unquantized, fp32 and bf16 serving."""
    from service.models.pipeline import PipelineRunner
    from service.models.request import GenerationRequest

    model = str(ensure_demo_model(preset))
    h, w, f = size
    req = GenerationRequest("a red fox running through snow", seed=7, height=h, width=w, num_frames=f,
                            num_inference_steps=steps)
    out: dict[str, Any] = {"preset": preset, "request": f"{w}x{h}x{f}, {steps} steps, CFG"}
    for dname, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        frames = {}
        runs = [("ref", None, None, False), ("upcast", "fp8", "upcast", False),
                ("upcast-dlo", "fp8", "upcast", True)]
        if dtype == torch.bfloat16:  # scaled_mm runs for bf16 inputs only (fp32 ones take upcast)
            runs.append(("scaled_mm", "fp8", "scaled_mm", False))
        for label, q, compute, offload in runs:
            mode = OffloadMode.ALLGATHER if offload else OffloadMode.RESIDENT
            dtype_name = str(dtype).removeprefix("torch.") if dtype else None
            settings = EngineConfig(offload=OffloadConfig(mode),
                                    model=ModelConfig(quantization=q, dtype=dtype_name))
            runner = PipelineRunner.load(model, "cpu", config=settings)
            if compute:
                set_compute(runner.transformer, compute, CPU)
            try:
                frames[label] = runner.frames(req)
            finally:
                runner.close()
        ref = frames.pop("ref")
        res: dict[str, Any] = {k: {"psnr_db": psnr(v, ref), "max_abs_diff": int(np.abs(
            v.astype(np.int16) - ref.astype(np.int16)).max())} for k, v in frames.items()}
        res["upcast-dlo"]["bitwise_equal_resident_fp8"] = frames["upcast-dlo"].tobytes() == \
            frames["upcast"].tobytes()
        res["sha256_ref"] = hashlib.sha256(ref.tobytes()).hexdigest()
        out[dname] = res
    return out


def psnr(a: np.ndarray, b: np.ndarray) -> float | None:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return None if mse == 0 else 10 * math.log10(255.0**2 / mse)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2, help="14B-shaped blocks for the transformer part")
    p.add_argument("--tokens", type=int, default=256, choices=sorted(LATENTS))
    p.add_argument("--sizes", type=lambda s: [parse_probe_size(x) for x in s.split(",")], default=None,
                   help="WIDTHxHEIGHTxFRAMES for tiny,small (default 32x32x5,128x128x9)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", help="default loadtest/results/cpu-fp8-<date>.json")
    args = p.parse_args(argv)
    sizes = args.sizes or [[32, 32, 5], [128, 128, 9]]
    t0 = time.perf_counter()
    report: dict[str, Any] = {**header("cpu"), "threads": torch.get_num_threads()}
    big = Path(tempfile.gettempdir()) / f"dloserve-fp8err-wan14b-shape-L{args.layers}"
    if not (big / "model_index.json").is_file():
        write_demo_model(big, "wan14b-shape", args.layers)
    report["bytes"] = block_bytes(str(big))
    print("bytes", json.dumps(report["bytes"]), flush=True)
    report["transformer"] = {
        f"wan14b-shape-L{args.layers}": transformer_error(str(big), args.tokens, None),
        "small-bf16": transformer_error(str(ensure_demo_model("small")), 1024, torch.bfloat16)}
    print("transformer", json.dumps(report["transformer"]), flush=True)
    report["frames"] = [frames_psnr(preset, size, args.steps)
                        for preset, size in zip(("tiny", "small"), sizes, strict=True)]
    print("frames", json.dumps(report["frames"]), flush=True)
    report["seconds"] = time.perf_counter() - t0
    out = Path(args.out or Path(__file__).parent / "results" / f"cpu-fp8-{report['date'][:10]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
