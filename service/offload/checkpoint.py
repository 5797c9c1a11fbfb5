"""safetensors checkpoints as read-only mmap views.

Every process that opens the same file maps the same page-cache pages, so N ranks on
one host cost one copy of the checkpoint. We parse the safetensors header ourselves
(8-byte little-endian length, then JSON) to know each tensor's byte range: that lets us
check a truncated or corrupt file at open time and hand out zero-copy views.

Views come from ``mmap.ACCESS_READ`` mappings: writing into one faults, so nothing can
turn a shared page into a private copy by accident.

A view a CPU module computes with directly is first made ``compute_aligned``: a view sits
where the file puts it (8-byte alignment in safetensors), and a CPU BLAS picks its GEMM
kernel by the operands' alignment (MKL on an AMD EPYC host: the same weights at another
offset gave other last bits). With every such tensor on a 64-byte boundary, a request's
bytes do not depend on how its weights were stored (a source checkpoint quantized at
load, or a ``dloserve quantize`` folder: tests/models/test_fp8.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import struct
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .files import CheckpointError, checkpoint_files

COMPUTE_ALIGN = 64  # bytes: a cache line, an AVX-512 register; torch's CPU allocator's own alignment


def compute_aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a private copy of it where a CPU tensor's data is off a ``COMPUTE_ALIGN``
    boundary (the copy costs host memory: the view shared the page cache)."""
    if t.device.type != "cpu" or t.data_ptr() % COMPUTE_ALIGN == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}



@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor's bytes are; a derived tensor is computed from a stored one."""

    key: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file (derived: the source's bytes)
    end: int
    source: TensorRecord | None = None  # derived: the stored tensor it is computed from
    # derived: rows of the source -> the same rows of this tensor (row-local, deterministic)
    derive: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class _MappedFile:
    """One safetensors file mapped read-only; hands out typed views by byte range."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            self.map = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else None
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            # The buffer is read-only on purpose (see module docstring).
            warnings.simplefilter("ignore", UserWarning)
            self.bytes = (
                torch.frombuffer(self.map, dtype=torch.uint8)
                if self.map is not None
                else torch.empty(0, dtype=torch.uint8)
            )

    def view(self, rec: TensorRecord) -> torch.Tensor:
        raw = self.bytes[rec.begin : rec.end]
        if rec.begin % rec.dtype.itemsize:
            # safetensors writers keep offsets aligned; an odd one needs a private copy.
            raw = raw.clone()
        return raw.view(rec.dtype).view(rec.shape)

    def release(self, begin: int, end: int) -> None:
        """Drop this process's page mappings of [begin, end); the page cache keeps them.

        Only PSS falls: a later read of the range faults the pages back in from cache.
        """
        if self.map is None:
            return
        page = mmap.PAGESIZE
        lo = begin // page * page
        hi = min(-(-end // page) * page, len(self.map))
        if hi > lo:
            self.map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def _read_header(path: Path) -> tuple[dict, int]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: file is too short to be safetensors ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 * 2**20:
                raise CheckpointError(
                    f"{path}: header length {n} does not fit the file ({size} bytes); "
                    "the file is truncated or not safetensors"
                )
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    return header, 8 + n


def _records(path: Path) -> dict[str, TensorRecord]:
    header, data_start = _read_header(path)
    size = path.stat().st_size
    out: dict[str, TensorRecord] = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = DTYPES[meta["dtype"]]
            shape = tuple(int(s) for s in meta["shape"])
            lo, hi = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: bad header entry for key {key!r}: {e}") from e
        numel = 1
        for s in shape:
            numel *= s
        if hi - lo != numel * dtype.itemsize or lo < 0:
            raise CheckpointError(
                f"{path}: key {key!r} has byte range [{lo}, {hi}) that does not match "
                f"shape {list(shape)} of {meta['dtype']}"
            )
        if data_start + hi > size:
            raise CheckpointError(
                f"{path}: key {key!r} ends at byte {data_start + hi} but the file has "
                f"{size} bytes: the file is truncated"
            )
        out[key] = TensorRecord(key, path, dtype, shape, data_start + lo, data_start + hi)
    return out


CheckpointPath = str | os.PathLike | Mapping[str, str | os.PathLike]


class Checkpoint:
    """All tensors of a (possibly sharded) safetensors checkpoint, mapped read-only.

    ``path`` is one checkpoint, or a mapping of key prefix -> checkpoint: several component
    folders served as one module (a two-expert pipeline's ``transformer`` and
    ``transformer_2``, keys ``"transformer." + key`` and ``"transformer_2." + key``).
    """

    def __init__(self, path: CheckpointPath) -> None:
        roots = list(path.items()) if isinstance(path, Mapping) else [("", path)]
        if not roots:
            raise CheckpointError("checkpoint: an empty mapping of prefixes")
        paths = [Path(r) for _, r in roots]
        self.path = paths[0] if len(paths) == 1 else Path(os.path.commonpath(paths))
        self.records: dict[str, TensorRecord] = {}  # what is served (stored, or derived)
        self._files: dict[Path, _MappedFile] = {}
        for prefix, root in roots:
            for f in checkpoint_files(root):
                for key, rec in _records(f).items():
                    key = prefix + key
                    if key in self.records:
                        raise CheckpointError(f"{f}: key {key!r} also stored in {self.records[key].file}")
                    self.records[key] = dataclasses.replace(rec, key=key) if prefix else rec
                self._files[f] = _MappedFile(f)
        self.stored = dict(self.records)  # what the files hold

    @property
    def nbytes(self) -> int:
        """Bytes the files hold (derived tensors are not stored)."""
        return sum(r.nbytes for r in self.stored.values())

    def derive(self, key: str, dtype: torch.dtype, shape: tuple[int, ...], source: str,
               fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Serve ``key`` as ``fn(stored tensor source)`` (it may replace ``source`` itself).

        ``fn`` must be row-local (row i of its output depends on row i of its input only)
        and deterministic: shards are built from row ranges, and must equal the whole.
        """
        src = self.stored[source]
        if not shape or src.shape[:1] != shape[:1]:
            raise ValueError(f"derived {key!r} {list(shape)} does not share rows with {source!r} "
                             f"{list(src.shape)}")
        self.records[key] = TensorRecord(key, src.file, dtype, tuple(shape), src.begin, src.end, src, fn)

    def is_derived(self, key: str) -> bool:
        return self.records[key].source is not None

    def view(self, key: str) -> torch.Tensor:
        """A zero-copy, read-only view of one tensor (derived: computed now, a new tensor)."""
        rec = self.records[key]
        if rec.source is not None:
            assert rec.derive is not None
            return rec.derive(self._files[rec.file].view(rec.source))
        return self._files[rec.file].view(rec)

    def flat(self, key: str, first: int, last: int) -> torch.Tensor:
        """Elements [first, last) of the flattened tensor; a derived one computes only the
        rows those elements lie in."""
        rec = self.records[key]
        if rec.source is None:
            return self._files[rec.file].view(rec).reshape(-1)[first:last]
        assert rec.derive is not None
        row = math.prod(rec.shape[1:])
        lo, hi = first // row, -(-last // row)
        rows = rec.derive(self._files[rec.file].view(rec.source)[lo:hi])
        return rows.reshape(-1)[first - lo * row : last - lo * row]

    def raw(self, key: str) -> torch.Tensor:
        """The tensor's bytes in the mapping (uint8, zero-copy, read-only, any alignment)."""
        rec = self.records[key]
        if rec.source is not None:
            raise ValueError(f"{key!r} is derived at load: its bytes are not in {rec.file.name}")
        return self._files[rec.file].bytes[rec.begin : rec.end]

    def mapped_bytes(self, keys: Iterable[str]) -> list[torch.Tensor]:
        """The whole mapping (uint8) of every file holding one of ``keys``: what DMA registers."""
        files = sorted({self.records[k].file for k in keys})
        return [self._files[f].bytes for f in files if self._files[f].bytes.numel()]

    def release(self, keys: Iterable[str]) -> None:
        """Unmap the pages behind ``keys`` from this process (they stay in page cache)."""
        for key in keys:
            rec = self.records[key]
            self._files[rec.file].release(rec.begin, rec.end)

    def validate(self, expected: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Check keys and shapes against what the module wants; name every offender."""
        missing = sorted(set(expected) - set(self.records))
        unexpected = sorted(set(self.records) - set(expected))
        problems: list[str] = []
        if missing:
            problems.append(f"missing keys {_few(missing)}")
        if unexpected:
            problems.append(f"unexpected keys {_few(unexpected)}")
        for key in sorted(set(expected) & set(self.records)):
            shape, dtype = expected[key]
            rec = self.records[key]
            if tuple(shape) != rec.shape:
                problems.append(
                    f"key {key!r} in {rec.file.name} has shape {list(rec.shape)}, "
                    f"the module expects {list(shape)}"
                )
            elif dtype.is_floating_point != rec.dtype.is_floating_point:
                problems.append(
                    f"key {key!r} in {rec.file.name} has dtype {rec.dtype}, "
                    f"the module expects {dtype}"
                )
        if problems:
            raise CheckpointError(f"checkpoint {self.path} does not match the module: " + "; ".join(problems))

    def close(self) -> None:
        self._files.clear()


def _few(keys: list[str], n: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:n])
    return f"[{shown}{', ...' if len(keys) > n else ''}] ({len(keys)} in all)"


def serving_dtype(
    key: str, stored: torch.dtype, dtype: torch.dtype | None, keep_fp32: Iterable[str] = ()
) -> torch.dtype:
    """The dtype a tensor is served in: the checkpoint's, or ``dtype`` for floating tensors.

    Names containing one of ``keep_fp32`` (diffusers' ``_keep_in_fp32_modules``) stay fp32.
    """
    if dtype is None or not stored.is_floating_point or stored.itemsize == 1:
        return stored  # fp8 is never cast: it needs its scales (offload.quant)
    parts = key.split(".")
    if any(m in parts for m in keep_fp32):
        return torch.float32
    return dtype
