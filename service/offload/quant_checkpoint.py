"""FP8 checkpoints: quantize online at load, or read a checkpoint quantized offline.

Online, each quantized weight becomes a derived tensor of the checkpoint (``Checkpoint.
derive``): the fp8 weight and its scales are computed from the stored bf16/fp32 rows when
the runtime reads them (a rank's shard reads only its rows). Offline, ``write_quantized``
writes the same bytes (the same functions) into safetensors files next to the untouched
tensors, so serving maps fp8 bytes straight from the page cache: N ranks still cost one
copy, and rank-local DMA reads the fp8 bytes as they are.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .checkpoint import Checkpoint
from .files import INDEX_SUFFIX, CheckpointError, checkpoint_files
from .quant import (
    FP8,
    NONE,
    SCALE_SUFFIX,
    Fp8,
    Fp8Compute,
    as_quantization,
    quantize_blocks,
    quantize_weight,
    resolve_compute,
    scale_key,
    weight_scales,
)

FORMAT = "fp8-e4m3fn-per-channel-pow2"  # safetensors __metadata__["dloserve_quantization"]


@dataclass(frozen=True)
class QuantState:
    """What ``quantize_module`` did: the method, where the fp8 bytes come from, the compute."""

    method: str
    source: str  # "online" (derived at load) or "prequantized" (stored in the files)
    compute: Fp8Compute
    weights: tuple[str, ...]

    keep_fp32 = (f"weight{SCALE_SUFFIX}",)  # scales stay fp32 whatever the serving dtype

    def stats(self) -> dict[str, str]:
        """The ``OffloadStats`` fields that say how the blocks are quantized."""
        return {"quantization": self.method, "quantization_source": self.source,
                "fp8_compute": self.compute.value}


def quantize_module(module: nn.Module, blocks: Sequence[tuple[str, nn.Module]], ckpt: Checkpoint,
                    quantization: str | Fp8 | None, device: torch.device) -> QuantState | None:
    """Make ``blocks``' Linears fp8 (on meta) and ``ckpt`` serve what they expect.

    ``quantization`` None takes the checkpoint's own: a folder ``dloserve quantize`` wrote
    (fp8 weights with scales) is served as fp8, any other as it is stored. ``"none"`` says
    no quantization outright, and a checkpoint that holds fp8 weights is then refused with
    the fix named (its weights are not plain matrices).
    """
    q = as_quantization(quantization)
    if q is None:
        q = Fp8() if prequantized_key(ckpt) else None
    if q is None or q == NONE:
        refuse_prequantized(ckpt)
        return None
    assert isinstance(q, Fp8)
    compute = resolve_compute(q.compute, device)
    weights = quantize_blocks(blocks, compute)
    source = serve_fp8(ckpt, weights)
    return QuantState(q.name, source, compute, tuple(weights))


def serve_fp8(ckpt: Checkpoint, weights: Iterable[str]) -> str:
    """Have ``ckpt`` serve each of ``weights`` as fp8 + scale; "online" or "prequantized".

    A missing weight is left for ``Checkpoint.validate`` to name; a checkpoint where some
    weights are quantized and others not is refused (it was not written by one tool).
    """
    stored, online = [], []
    for key in weights:
        rec = ckpt.stored.get(key)
        if rec is None:
            continue
        skey = scale_key(key)
        if rec.dtype == FP8:
            if skey not in ckpt.stored:
                raise CheckpointError(f"{rec.file}: {key!r} is float8 but {skey!r} is missing")
            stored.append(key)
            continue
        if not rec.dtype.is_floating_point or len(rec.shape) != 2:
            raise CheckpointError(f"{rec.file}: {key!r} is {rec.dtype} {list(rec.shape)}, "
                                  "not a 2-D floating weight to quantize")
        if skey in ckpt.stored:
            raise CheckpointError(f"{rec.file}: {skey!r} is stored but {key!r} is {rec.dtype}, not float8")
        ckpt.derive(key, FP8, rec.shape, key, quantize_weight)
        ckpt.derive(skey, torch.float32, rec.shape[:1], key, weight_scales)
        online.append(key)
    if stored and online:
        raise CheckpointError(f"checkpoint {ckpt.path}: {len(stored)} weights are float8 and {len(online)} "
                              f"are not (e.g. {online[0]!r}): quantize all of them or none")
    return "prequantized" if stored else "online"


def prequantized_key(ckpt: Checkpoint) -> str | None:
    """The first fp8 weight's scale key if ``ckpt`` holds fp8 weights with scales (a folder
    ``dloserve quantize`` wrote), else None."""
    for key in ckpt.stored:
        if key.endswith(f".weight{SCALE_SUFFIX}") and getattr(ckpt.stored.get(key[: -len(SCALE_SUFFIX)]),
                                                              "dtype", None) == FP8:
            return key
    return None


def refuse_prequantized(ckpt: Checkpoint) -> None:
    """A checkpoint with fp8 weights and scales cannot be served unquantized: say so."""
    key = prequantized_key(ckpt)
    if key is not None:
        raise CheckpointError(f"checkpoint {ckpt.path} holds fp8 weights with scales ({key!r} in "
                              f"{ckpt.stored[key].file.name}, written by `dloserve quantize`): it cannot be "
                              "served unquantized; drop --quantization none (its own fp8 is read by default)")


def write_quantized(src: str | os.PathLike, dst: str | os.PathLike, weights: Iterable[str],
                    progress: Callable[[int, int], None] | None = None) -> dict:
    """Write the checkpoint ``src`` to the folder ``dst`` with ``weights`` in fp8 + scales.

    One output file per input file, same names (and a rewritten index), one file's tensors
    in memory at a time; the other tensors are copied as stored. Returns a summary.
    """
    from safetensors.torch import save_file

    ckpt = Checkpoint(src)
    wanted = set(weights)
    missing = sorted(wanted - set(ckpt.stored))
    if missing:
        raise CheckpointError(f"checkpoint {src}: no weights {missing[:4]} to quantize "
                              f"({len(missing)} in all)")
    serve_fp8(ckpt, wanted)
    out = Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    files = checkpoint_files(src)
    weight_map: dict[str, str] = {}
    total = quantized = 0
    for i, f in enumerate(files):
        keys = [k for k, r in ckpt.stored.items() if r.file == f]
        tensors: dict[str, torch.Tensor] = {}
        for key in sorted(keys, key=lambda k: ckpt.stored[k].begin):  # the file's own order
            tensors[key] = ckpt.view(key).contiguous()
            if key in wanted:
                tensors[scale_key(key)] = ckpt.view(scale_key(key))
                quantized += 1
        for key, t in tensors.items():
            weight_map[key] = f.name
            total += t.numel() * t.element_size()
        save_file(tensors, out / f.name, metadata={"format": "pt", "dloserve_quantization": FORMAT})
        del tensors
        if progress is not None:
            progress(i + 1, len(files))
    index = sorted(Path(src).glob("*" + INDEX_SUFFIX)) if Path(src).is_dir() else []
    if index:
        doc = json.loads(index[0].read_text())
        doc["metadata"] = {**doc.get("metadata", {}), "total_size": total, "dloserve_quantization": FORMAT}
        doc["weight_map"] = dict(sorted(weight_map.items()))
        (out / index[0].name).write_text(json.dumps(doc, indent=2) + "\n")
    if Path(src).is_dir():  # config and other small files of the folder travel along
        for p in Path(src).iterdir():
            if p.is_file() and not p.name.endswith(".safetensors") and not p.name.endswith(INDEX_SUFFIX):
                shutil.copy2(p, out / p.name)
    summary = {"files": len(files), "quantized_weights": quantized, "bytes": total,
               "source_bytes": ckpt.nbytes, "format": FORMAT}
    ckpt.close()
    return summary
