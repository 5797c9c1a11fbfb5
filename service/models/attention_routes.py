"""Which attention kernels can run here (``available``), and which exact one serves each shape
(``Routes``): a table measured on the device at load, kept between starts.

Exact candidates: torch's SDPA under ``ORDER`` (cuDNN first; always there, the fallback) and
flash-attn-4 (service.models.fa4_attention; CUDA sm90, the ``gpu`` extra installed). At load
each candidate is timed at the model's heads and dtype on Wan's shapes (``SHAPES``: self-attention
at 4,096 / 32,760 / 75,600 tokens and cross-attention from those to 512 text tokens, CFG batch
2) and ``choose`` keeps SDPA unless another is faster by more than ``MARGIN`` and within
``ERROR_BOUND`` of it (bf16 level). A call takes the route of the nearest measured shape of its
kind; where every shape of a kind chose one kernel the route reads no shape at all (no guard,
no recompile in a compiled block). The table is stored in ``$DLOSERVE_CACHE/attention`` keyed
by the GPU, torch, cuDNN and flash-attn-4 versions and the heads (``source: cached``), as the
probe cache keeps auto mode's timings; delete the folder to measure again.

``choose``, ``Routes`` and ``why_not`` are plain Python (tested on the CPU); the measuring
needs a GPU (loadtest/gpu_check_attention.py is its check; first run on an H200 2026-12-05).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from functools import cache
from importlib import metadata
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

log = logging.getLogger("dloserve.models")

EXTRA = "pip install -e '.[gpu]' (requirements-gpu.lock)"
ORDER = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
         SDPBackend.MATH)
ERROR_BOUND = 0.01  # relative error to SDPA an exact kernel may have (fa4 measured 0.0023)
MARGIN = 0.02  # faster by more than this, or SDPA keeps the shape (one moving part fewer)
TABLE_VERSION = 2  # 2: the candidates timed in turns (tables of 1 are measured again)
SELF_TOKENS = (4096, 32760, 75600)
TEXT_TOKENS = 512
CFG_BATCH = 2


@dataclass(frozen=True)
class Kernel:
    """A kernel that may not run here: what it is called in errors, its wheel and import name."""

    what: str
    wheel: str | None  # the PyPI distribution of the gpu extra (None: comes with torch)
    module: str


KERNELS = {"fa4": Kernel("flash-attn-4", "flash-attn-4", "flash_attn.cute"),
           "cudnn_fp8": Kernel("cuDNN's FP8 attention (nvidia-cudnn-frontend)", "nvidia-cudnn-frontend",
                               "cudnn")}


def why_not(kernel: str, device_type: str, capability: tuple[int, int] | None,
            import_error: str | None) -> str | None:
    """Why ``kernel`` cannot run on a ``device_type`` device of ``capability`` whose import
    failed with ``import_error`` (None: it imported), or None where it can."""
    k = KERNELS[kernel]
    if device_type != "cuda":
        return f"{k.what} needs a CUDA GPU (this server computes on {device_type})"
    if capability is None or capability[0] != 9:
        got = f"sm{capability[0]}{capability[1]}" if capability else "unknown"
        return f"{k.what} is served on Hopper GPUs only (sm90, compute capability 9.x; this one is {got})"
    if import_error is not None:
        fix = f"; install the gpu extra: {EXTRA}" if k.wheel else ""
        return f"{k.what} is not importable ({import_error}){fix}"
    return None


def import_error(kernel: str) -> str | None:
    """None where ``kernel``'s module imports, else the error's first line."""
    if kernel == "fa4":
        from . import fa4_attention

        fa4_attention.keep_cache()  # before its import reads the switch
    try:
        importlib.import_module(KERNELS[kernel].module)
    except Exception as e:  # noqa: BLE001 - a missing wheel, or one whose libraries do not load
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    return None


@cache
def available(kernel: str, device: torch.device) -> str | None:
    """None where ``kernel`` runs on ``device``, else why not (a CPU never imports the wheel)."""
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    why = why_not(kernel, device.type, cap, None)
    return why if why is not None else why_not(kernel, device.type, cap, import_error(kernel))


# -- the routing rule -------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """One attention call's shape: self (q and kv the same tokens) or cross."""

    kind: str
    q_tokens: int
    kv_tokens: int
    heads: int
    head_dim: int
    batch: int = CFG_BATCH


def shapes(heads: int, head_dim: int) -> list[Shape]:
    """The shapes measured at load: Wan's self-attention sizes and their cross-attention."""
    return [Shape(kind, t, t if kind == "self" else TEXT_TOKENS, heads, head_dim)
            for t in SELF_TOKENS for kind in ("self", "cross")]


def choose(timings: Mapping[str, float | str], errors: Mapping[str, float]) -> tuple[str, str]:
    """The kernel for one shape from its ``timings`` (ms; a string: the candidate failed, why)
    and ``errors`` (relative to SDPA), and why: SDPA unless another is faster by more than
    ``MARGIN`` and within ``ERROR_BOUND``."""
    base = timings["sdpa"]
    if isinstance(base, str):
        raise ValueError(f"SDPA must have a time, got {base!r}")
    best, best_ms, notes = "sdpa", float(base), []
    for name, ms in timings.items():
        if name == "sdpa":
            continue
        if isinstance(ms, str):
            notes.append(f"{name} failed ({ms})")
        elif errors.get(name, math.inf) > ERROR_BOUND:
            notes.append(f"{name} not exact (error {errors.get(name, math.inf):.2g} > {ERROR_BOUND:g})")
        elif ms < base * (1 - MARGIN) and ms < best_ms:
            best, best_ms = name, ms
        else:
            notes.append(f"{name} {ms:.2f} ms, not {MARGIN:.0%} faster")
    why = f"sdpa {base:.2f} ms"
    if best != "sdpa":
        why += f", {best} {best_ms:.2f} ms ({base / best_ms:.2f}x)"
    return best, "; ".join([why, *notes])


@dataclass(frozen=True)
class Routes:
    """The exact kernel per shape: measured entries, and ``default`` for a kind none measured."""

    entries: tuple[tuple[Shape, str], ...] = ()
    default: str = "sdpa"
    source: str = "rule"  # rule | flag | measured | cached
    why: str = ""
    details: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    def kernel(self, kind: str, q_tokens: int, kv_tokens: int, heads: int, head_dim: int) -> str:
        """The route of the nearest measured shape of this kind, heads and head dim (log tokens).
        Where all of them agree no token count is read (a compiled block gets no shape guard)."""
        same = [(s, k) for s, k in self.entries if (s.kind, s.heads, s.head_dim) == (kind, heads, head_dim)]
        if not same:
            return self.default
        if len({k for _, k in same}) == 1:
            return same[0][1]
        best, best_d = self.default, math.inf  # a loop, not min(key=): dynamo traces this in a block
        for s, k in same:
            d = abs(math.log(s.q_tokens / q_tokens)) + abs(math.log(s.kv_tokens / kv_tokens))
            if d < best_d:
                best, best_d = k, d
        return best

    def kernels(self) -> set[str]:
        return {k for _, k in self.entries} | {self.default}

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "default": self.default, "why": self.why,
                "routes": [{**asdict(s), "kernel": k, "why": dict(self.details).get(_name(s), "")}
                           for s, k in self.entries]}


def _name(s: Shape) -> str:
    return f"{s.kind}:{s.batch}x{s.q_tokens}->{s.kv_tokens}:{s.heads}x{s.head_dim}"


# -- measuring (GPU) ---------------------------------------------------------------------------


def _ms(fns: Mapping[str, Any], reps: int = 7) -> dict[str, float]:
    """Each candidate's GPU ms for one call: the fastest of ``reps`` samples, the candidates
    taking turns (each round in another order). Timed one after the other (5 calls of SDPA,
    then 5 of fa4, the median of each), the choice moved between machines: three H100s of one
    day put fa4 at 1.02x, 1.03x and 1.17-1.23x SDPA at 32,760 tokens (the first kept SDPA),
    while the second's 40-layer forward ran its self-attention 1.20x faster with fa4
    (2026-12-05). Not yet run on a GPU in this form."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fns[name]()
            b.record()
            b.synchronize()
            times[name].append(a.elapsed_time(b))
    return {name: min(t) for name, t in times.items()}


def measure(shape: Shape, dtype: torch.dtype, device: torch.device) -> tuple[dict[str, float | str],
                                                                             dict[str, float]]:
    """Each exact candidate's ms at ``shape`` and its error relative to SDPA (random inputs)."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from . import fa4_attention

    g = torch.Generator(device=device).manual_seed(shape.q_tokens)
    q = torch.randn(shape.batch, shape.q_tokens, shape.heads, shape.head_dim, device=device, dtype=dtype,
                    generator=g)
    k, v = (torch.randn(shape.batch, shape.kv_tokens, shape.heads, shape.head_dim, device=device, dtype=dtype,
                        generator=g) for _ in range(2))

    def exact() -> torch.Tensor:
        with sdpa_kernel(list(ORDER), set_priority=True):
            return sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    with torch.inference_mode():
        ref = exact().float()
        runs: dict[str, Any] = {"sdpa": exact}
        timings: dict[str, float | str] = {}
        errors: dict[str, float] = {}
        if available("fa4", device) is None:
            try:
                out = fa4_attention.attend(q, k, v).float()
                errors["fa4"] = float((out - ref).norm() / ref.norm())
                runs["fa4"] = lambda: fa4_attention.attend(q, k, v)
            except Exception as e:  # noqa: BLE001 - a kernel that fails here is not routed to
                timings["fa4"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        try:
            timings = {**_ms(runs), **timings}
        except Exception as e:  # noqa: BLE001 - fa4 failing while timed: SDPA keeps the shape
            if "fa4" not in runs:
                raise
            why = str(e).splitlines()[0][:160] if str(e) else ""
            timings = {**_ms({"sdpa": exact}), "fa4": f"{type(e).__name__}: {why}"}
    return timings, errors


def table_facts(heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """What the measured table depends on (its cache key, in the clear)."""

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {"table_version": TABLE_VERSION, "gpu": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), "flash_attn_4": version("flash-attn-4"),
            "heads": heads, "head_dim": head_dim, "dtype": str(dtype), "margin": MARGIN,
            "shapes": [asdict(s) for s in shapes(heads, head_dim)]}


def measured_routes(heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> Routes:
    """The table for this model on ``device``: from the cache, else measured now and stored."""
    from .demo import cache_dir

    facts = table_facts(heads, head_dim, dtype, device)
    path = cache_dir() / "attention" / (hashlib.sha256(json.dumps(facts, sort_keys=True).encode())
                                        .hexdigest()[:24] + ".json")
    if path.is_file():
        stored = json.loads(path.read_text())
        rows, source = stored["rows"], f"cached ({stored['date']})"
    else:
        rows = []
        for s in shapes(heads, head_dim):
            timings, errors = measure(s, dtype, device)
            rows.append({"shape": asdict(s), "timings": timings, "errors": errors})
        source = "measured"
        path.parent.mkdir(parents=True, exist_ok=True)
        stored = {"facts": facts, "date": dt.date.today().isoformat(), "rows": rows}
        path.write_text(json.dumps(stored, indent=1))
    entries, details = [], []
    for row in rows:
        s = Shape(**row["shape"])
        kernel, why = choose(row["timings"], row["errors"])
        entries.append((s, kernel))
        details.append((_name(s), why))
    log.info("attention routes (%s): %s", source, ", ".join(f"{_name(s)} {k}" for s, k in entries))
    return Routes(tuple(entries), "sdpa", source, "exact kernels timed on this GPU at the model's heads",
                  tuple(details))
