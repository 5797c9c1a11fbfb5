"""Regional compile under offload: the repeated transformer block under torch.compile.

Like diffusers' ``compile_repeated_blocks``, only the block class is compiled, once per class
(``torch.compile`` of the class's ``forward``; every block instance passes itself in), so a
40-block model compiles one graph. Unlike it, the module's call is not compiled, only its
``forward``: the offload's forward hooks (which point a block's parameters at a device slot
before its forward and back at placeholders after it) stay eager around the compiled region.
The parameters are graph inputs (dynamo inlines built-in modules and lifts their tensors), so
a slot swap changes only the tensors' storage, which no guard reads: no recompile after the
first forward of a shape (tests/models/test_compiled.py counts them on CPU with aot_eager).
The warm-up compiles the token count symbolic (``mark_token_dims``), so that first forward
is the warm-up's for every size a request can have.

What runs eager instead: a request with LoRA adapters (their side branches are per-request
forward hooks on the Linears inside the block; ``eager()`` while it runs). Step caches wrap the
block's ``forward`` from outside (diffusers' hook registry), so they call the compiled one.

Inductor's caches (the FX graph and AOT autograd caches, the generated kernels) are kept in
``$DLOSERVE_CACHE/inductor`` unless ``TORCHINDUCTOR_CACHE_DIR`` says otherwise: torch's default
is a folder in /tmp, which a reboot or a new container empties, and a start with the caches
skips the code generation (the demo model's block with inductor on a shared 2-core CPU host:
warm-up 148.6 s cold, 44.2 s from the cache, its FX and AOT graphs all hits). ``describe()``
says whether the warm-up's graphs came from the cache (``cache``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from . import coordesc_cache

log = logging.getLogger("dloserve.models")


def compile_on(model: Any, device: torch.device, adapter: Any) -> bool:
    """Whether the blocks run compiled (``--compile``); refused with sequence parallelism."""
    if adapter.sequence_parallel > 1:
        if model.compile == "on":
            raise ValueError("--compile on: not yet with --sequence-parallel-size > 1")
        return False
    return model.compiling(device.type)


def warmup_shape(adapter: Any, device: torch.device) -> tuple[int, int, int]:
    """The compile warm-up's (height, width, frames) without --dlo-probe-size: 832x480x81 on
    CUDA (the probe's), the smallest valid size on CPU (a graph per shape either way)."""
    if device.type == "cuda":
        return (480, 832, 81)
    mh, mw = getattr(adapter, "multiple", (16, 16))
    return (mh, mw, 1)


def backend_for(device: torch.device) -> str:
    """inductor on CUDA (the speed); aot_eager elsewhere (CPU: the same graphs and guards,
    no C++ toolchain, for tests of the composition)."""
    return "inductor" if device.type == "cuda" else "aot_eager"


# inductor's coordinate-descent tuning of its generated kernels (the norms, RoPE, the residual adds,
# FP8's quantization), only where the blocks run FP8 weights. There it made a 40-layer CFG step
# 0.93-0.99% faster on two H100s (2026-12-05, loadtest/results/h100-attention-check-2026-12-05-*.json);
# exact bf16 it gained 0.29-0.35% and cost the start: on an H200, 12 Wan-14B layers were ready in
# 74.3 s against 69.1 s without it with inductor's caches warm, 105.9 s against 78.8 s cold
# (h200-startup-2026-12-05-12-cdt.json, -12-nocdt.json): torch 2.11 tunes again on a cache hit.
FP8_INDUCTOR_OPTIONS = {"coordinate_descent_tuning": True}


def options_for(backend: str | Callable[..., Any], quantization: str | None) -> dict[str, Any] | None:
    """torch.compile's ``options``: inductor's coordinate-descent tuning for FP8 weights; none
    otherwise (other backends take none)."""
    return dict(FP8_INDUCTOR_OPTIONS) if backend == "inductor" and quantization == "fp8" else None


def keep_inductor_cache() -> str:
    """``TORCHINDUCTOR_CACHE_DIR``, set to ``$DLOSERVE_CACHE/inductor`` unless it names another
    folder than torch's default (torch reads it at each cache access): the folder. torch
    writes its own default into the variable the first time anything asks for the folder (on
    the H200 something had before the blocks were compiled: the warm-up's caches went to
    /tmp/torchinductor_root), so that value is not taken for a user's choice."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from .demo import cache_dir

    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given is None or os.path.abspath(given) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


PHASES_SHOWN = 8  # the slowest of torch's compile phases that describe() lists
WARM_CALLS = 2  # block calls per class the warm-up computes (CompiledBlocks._warm_call)
CACHE_COUNTERS = (("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
                  ("aot_autograd", "autograd_cache_hit"), ("aot_autograd", "autograd_cache_miss"))


def _phase_seconds() -> dict[str, float]:
    """torch's own compile timings so far (dynamo's trace, AOT autograd, inductor, the cache
    loads), seconds per phase summed: where a warm-up's seconds go. Empty where torch no
    longer keeps them."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return {}
    return {name: float(sum(times)) for name, times in compilation_time_metrics.items()}


def _cache_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {name: int(counters[group][name]) for group, name in CACHE_COUNTERS}


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors among a call's arguments, and those inside tuple or list arguments (the
    rotary embedding's cos and sin)."""
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (tuple, list)) else (a,)):
            if isinstance(t, torch.Tensor):
                yield t


def mark_token_dims(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Mark the token dimension of a block call's inputs symbolic for the compile: how many
    dims were marked.

    The token count is the first tensor's dim 1 (the hidden states, [batch, tokens, channels]);
    every dim of that size but a tensor's last (channels, head dims) is marked: the hidden
    states, the rotary tables, a per-token modulation. Without it the warm-up compiles a graph
    for its one size and the first request of another size compiles again, dynamic then
    (torch's automatic dynamic shapes): on the H200 0.2-0.5 s of that request's first step
    with the caches warm, the whole compile on a new machine. ``maybe_mark_dynamic``: where
    the graph must specialize the size after all, dynamo does so (and compiles per size, as
    before) instead of failing the warm-up. A token count of 0 or 1 is not marked (torch
    specializes those)."""
    first = next(_tensors(args, kwargs), None)
    if first is None or first.dim() < 2 or first.shape[1] < 2:
        return 0
    tokens, marked = first.shape[1], 0
    for t in _tensors(args, kwargs):
        for dim in range(t.dim() - 1):
            if t.shape[dim] == tokens:
                torch._dynamo.maybe_mark_dynamic(t, dim)
                marked += 1
    return marked


class CompiledBlocks:
    """The blocks of ``transformer``'s block lists, their ``forward`` compiled per class.

    ``backend``: a torch.compile backend (a name or a callable, e.g. a counting one in tests);
    ``quantization``: the blocks' weights ("fp8" or None), which decides inductor's options.
    """

    def __init__(self, transformer: nn.Module, block_attrs: tuple[str, ...] | list[str],
                 backend: str | Callable[..., Any], *, quantization: str | None) -> None:
        self.backend = backend
        self.quantization = quantization
        self.cache_dir = keep_inductor_cache() if backend == "inductor" else None
        self.patched = coordesc_cache.apply() if backend == "inductor" else None  # torch 2.9-2.12's re-tuning
        self.cache: dict[str, int] = {}
        self._eager = 0
        self._compiled: dict[type, Callable[..., Any]] = {}
        self._blocks: list[nn.Module] = []
        for attr in block_attrs:
            for blk in transformer.get_submodule(attr):
                cls = type(blk)
                if cls not in self._compiled:
                    self._compiled[cls] = torch.compile(cls.forward, backend=backend, fullgraph=True,
                                                        options=options_for(backend, quantization))
                blk.forward = self._dispatch(blk, self._compiled[cls], blk.forward)
                self._blocks.append(blk)
        self.classes = sorted(c.__name__ for c in self._compiled)
        self.warmup_s = 0.0
        self.phases: dict[str, float] = {}  # the warm-up's seconds by torch's compile phase
        self._warming: dict[type, list[Any]] | None = None  # outputs by class, during the warm-up
        self.warm_calls: dict[str, int] = {}  # the warm-up's computed block calls, by class
        self.dynamic_dims = 0  # input dims the warm-up compiled symbolic (mark_token_dims)

    def _dispatch(self, blk: nn.Module, compiled: Callable[..., Any], eager: Callable[..., Any]
                  ) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._eager:
                return eager(*args, **kwargs)
            if self._warming is None:
                return compiled(blk, *args, **kwargs)
            self.dynamic_dims = max(self.dynamic_dims, mark_token_dims(args, kwargs))
            return self._warm_call(type(blk), lambda: compiled(blk, *args, **kwargs))

        return forward

    @contextmanager
    def eager(self, on: bool = True) -> Iterator[None]:
        """Blocks run uncompiled inside (``on``): a request whose hooks would change the graph."""
        self._eager += int(on)
        try:
            yield
        finally:
            self._eager -= int(on)

    def _warm_call(self, cls: type, call: Callable[[], Any]) -> Any:
        """A block's forward during the warm-up: the first ``WARM_CALLS`` of each class run
        (compiled), every later one returns the last of their outputs. The compile needs
        one call of the graph, and a second: its input is then a block's output, whose
        strides may differ from the first block's input (a guard would fail and recompile at
        the first request); the other blocks' compute (28 of 40 blocks' seconds on the H200)
        would only be thrown away. Their offload hooks still run: each block is streamed."""
        assert self._warming is not None
        runs = self._warming.setdefault(cls, [])
        if len(runs) < WARM_CALLS:
            runs.append(call())
        return runs[-1]

    def warm_up(self, forward: Callable[[], Any]) -> float:
        """Run ``forward`` once (the compile happens here, at start-up); its seconds."""
        t0 = time.perf_counter()
        before, phases = _cache_counts(), _phase_seconds()
        self._warming = {}
        try:
            with torch.no_grad():  # as diffusers' pipeline runs it: the same grad-mode guard
                forward()
        finally:
            self.warm_calls = {c.__name__: len(r) for c, r in self._warming.items()}
            self._warming = None
        self.warmup_s = time.perf_counter() - t0
        self.cache = {k: v - before[k] for k, v in _cache_counts().items()}
        spent = {k: v - phases.get(k, 0.0) for k, v in _phase_seconds().items()}
        top = sorted(spent.items(), key=lambda kv: -kv[1])[:PHASES_SHOWN]
        self.phases = {k: round(v, 3) for k, v in top if v >= 0.01}
        log.info("compiled %s (%d blocks, backend %s): warm-up %.1f s; caches %s", ", ".join(self.classes),
                 len(self._blocks), self.backend_name, self.warmup_s, self.cache)
        return self.warmup_s

    @property
    def backend_name(self) -> str:
        return self.backend if isinstance(self.backend, str) else "custom"

    def describe(self) -> dict[str, Any]:
        return {"classes": self.classes, "blocks": len(self._blocks), "backend": self.backend_name,
                "warmup_s": round(self.warmup_s, 3), "warm_calls": self.warm_calls,
                "dynamic_dims": self.dynamic_dims, "phases_s": self.phases,
                "cache": {**self.cache, "dir": self.cache_dir}, "patched": self.patched}

    def close(self) -> None:
        """The blocks' own forward back (the class's, looked up again)."""
        for blk in self._blocks:
            blk.__dict__.pop("forward", None)
        self._blocks.clear()
