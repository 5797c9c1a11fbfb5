"""A checkpoint's files and what their headers say, read without torch: the launcher's and the
front end's model checks (``dloserve serve`` imports no torch for them) and the loaders share it."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

INDEX_SUFFIX = ".safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint does not match the module, or is damaged. The message names the key/file."""


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint: one file, or a folder with an index."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise CheckpointError(f"{p}: checkpoint path does not exist")
    indexes = sorted(p.glob("*" + INDEX_SUFFIX))
    if len(indexes) > 1:
        raise CheckpointError(f"{p}: more than one {INDEX_SUFFIX} file: {[i.name for i in indexes]}")
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
        except (OSError, KeyError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{indexes[0]}: cannot read weight_map: {e}") from e
        files = sorted({p / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: shard named in {indexes[0].name} is missing")
        return files
    singles = sorted(p.glob("*.safetensors"))
    if len(singles) != 1:
        raise CheckpointError(
            f"{p}: expected one .safetensors file or an {INDEX_SUFFIX}, found {len(singles)}"
        )
    return singles


def stored_format(path: str | os.PathLike) -> str | None:
    """The quantization format ``write_quantized`` stamped into the checkpoint's files
    (their safetensors header), or None: the header alone is read, no tensor is mapped."""
    for f in checkpoint_files(path):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n)) if 0 < n <= 100_000_000 else {}
        meta = header.get("__metadata__") or {}
        if meta.get("dloserve_quantization"):
            return str(meta["dloserve_quantization"])
    return None
