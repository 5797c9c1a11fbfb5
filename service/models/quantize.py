"""``dloserve quantize SRC DST``: a diffusers pipeline folder whose transformer is fp8.

DST has SRC's layout. Every file is copied as it is except the transformer's safetensors,
which hold the blocks' Linear weights in float8_e4m3fn plus one fp32 ``weight_scale`` per
weight (``service.offload.quant_checkpoint.write_quantized``: the bytes online quantization
gives). Serving DST with ``--quantization fp8`` maps the fp8 bytes themselves: the page
cache holds half of SRC's transformer, one copy for every rank of the host, and the
rank-local mode DMAs them as stored.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path
from typing import Any

from service.offload import find_blocks
from service.offload.files import INDEX_SUFFIX
from service.offload.quant import Fp8Compute, quantize_blocks
from service.offload.quant_checkpoint import write_quantized

from .adapter import ModelError
from .progress import progress_bar
from .registry import load_adapter

METHODS = ("fp8",)


def quantize_pipeline(src: str | Path, dst: str | Path, method: str = "fp8", progress: bool = False
                      ) -> dict[str, Any]:
    """Write ``src`` (a pipeline folder) to the new or empty folder ``dst`` with an fp8 transformer."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    src, dst = Path(src).resolve(), Path(dst).resolve()
    adapter = load_adapter(src)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst}: exists and is not an empty folder")
    if dst == src or src in dst.parents:
        raise ModelError(f"{dst}: must be outside the source folder {src}")
    module = adapter.build_transformer()  # on meta: only its structure is read
    weights = quantize_blocks(find_blocks(module, list(adapter.block_attrs)), Fp8Compute.UPCAST)
    ckpt = adapter.transformer_checkpoint()
    transformer = src / "transformer"

    def ignore(folder: str, names: list[str]) -> list[str]:
        if Path(folder) != transformer:
            return []
        return [n for n in names if n.endswith(".safetensors") or n.endswith(INDEX_SUFFIX)]

    t0 = time.perf_counter()
    shutil.copytree(src, dst, ignore=ignore, dirs_exist_ok=True)
    bar = progress_bar("quantizing transformer files", "file") if progress else None
    summary = write_quantized(ckpt, dst / "transformer", weights, progress=bar)
    return {**summary, "src": str(src), "dst": str(dst), "method": method,
            "seconds": round(time.perf_counter() - t0, 2)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a diffusers pipeline folder (bf16 or fp32 transformer)")
    p.add_argument("dst", help="new or empty folder to write")
    p.add_argument("--method", choices=METHODS, default="fp8",
                   help="fp8: block Linear weights in float8_e4m3fn, per-output-channel fp32 scales")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    s = quantize_pipeline(args.src, args.dst, args.method, progress=not args.quiet)
    print(f"wrote {s['dst']}: {s['quantized_weights']} weights in {s['method']}, transformer "
          f"{s['source_bytes'] / 1e9:.2f} GB -> {s['bytes'] / 1e9:.2f} GB in {s['seconds']:.1f} s")
    return 0
