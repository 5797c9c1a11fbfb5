"""Which attention kernel runs, chosen on purpose and reported (``--attention``).

Exact (the default, ``exact``): SDPA under a priority order set here, exact kernels only, fastest
first as measured on an H200 at the Wan2.1-14B shape (40 heads x 128, bf16;
loadtest/results/h200-compute-2026-12-02.json, self + cross attention of one block at 32,760
tokens): cuDNN 39.4 ms, flash 61.8 ms, memory-efficient 122.8 ms; and, for Wan, flash-attn-4
wherever a table measured on this GPU at load says it is faster (service.models.attention_routes:
CUDA sm90 with the ``gpu`` extra; elsewhere SDPA, and the report says why). ``sdpa`` keeps SDPA
everywhere; ``fa4`` sends every Wan attention call flash-attn-4 takes to it (refused where it
cannot run). What runs for the model's own head shape and dtype is reported at load (the log,
``describe()``, and ``/readyz``'s last start).

Approximate, opt-in, Wan's self-attention on Hopper GPUs only; cross-attention, masked and
sequence-parallel calls stay exact (SP refuses them: engine config):

- ``fp8``: cuDNN's FP8 SDPA (service.models.cudnn_fp8_attention), q, k, v quantized per tensor
  inside the compiled block. Measured on an H200 (2026-12-05, loadtest/results/
  h200-attention-check-2026-12-05-*.json): the kernel 1.44x cuDNN bf16 at 32,760 tokens, a
  40-layer CFG step 4.78 s against 5.25 s exact. (Our own Triton FP8 kernel, measured beside it
  at 0.95-1.05x cuDNN bf16, was deleted.)

The kernels other than SDPA take half-precision inputs only: a model computing in float32 (the
trained demo model's float32 checkpoint, or ``--dtype float32``) is refused them by name rather
than served SDPA under another kernel's name.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from service.config.errors import FlagError

from . import cudnn_fp8_attention, fa4_attention, fused_gemms
from .attention_routes import ORDER, Routes, available, measured_routes

WHY = ("exact kernels, fastest first as measured on an H200 at 40 heads x 128 bf16: cuDNN 39.4 ms, "
       "flash 61.8 ms, memory-efficient 122.8 ms (self + cross attention of one block, 32,760 tokens)")

# --attention -> (the approximate self-attention kernel, the kernel availability names)
APPROXIMATE = {"fp8": "cudnn_fp8"}
NEEDS = {"fa4": "fa4", "fp8": "cudnn_fp8"}
HEAD_DIMS = {"fp8": cudnn_fp8_attention.HEAD_DIMS}
HALF = (torch.bfloat16, torch.float16)  # what fa4 and cuDNN's FP8 take (the router passes the rest to SDPA)
ERROR = {"fp8": "per-tensor e4m3 q, k, v, P and O: 0.060 relative error per call (random inputs, 32,760 "
                "tokens), a 40-layer forward 0.011 (53.2 dB) from exact, random weights (H200, 2026-12-05)"}
MAIN = (32760, 512)  # the shape a report names: Wan 480p x 81 frames, and its text tokens

_measured = Routes()  # the exact routes of the model this process loaded (report() sets them)


def routes_for(backend: str) -> Routes:
    """The exact routes under ``backend``: forced by sdpa / fa4, else the measured ones."""
    if backend == "sdpa":
        return Routes(source="flag", why="--attention sdpa")
    if backend == "fa4":
        return Routes(default="fa4", source="flag", why="--attention fa4")
    return _measured


@contextmanager
def chosen(backend: str = "exact", fusions: frozenset[str] = fused_gemms.FUSIONS) -> Iterator[None]:
    """SDPA with the priority order above (torch falls through to the next kernel where one
    does not support the inputs, e.g. cuDNN on the CPU); where a route or ``backend`` sends
    Wan's attention elsewhere, Wan's dispatch is our router for the duration (the same router
    object each time, so a compiled block traced under it is not recompiled). GEMMs are
    fused with their neighbours in compiled blocks (service.models.fused_gemms; ``fusions``
    fewer: the measurement's baselines)."""
    with sdpa_kernel(list(ORDER), set_priority=True), fused_gemms.fused(fusions):
        routes, approx = routes_for(backend), APPROXIMATE.get(backend)
        if approx is None and routes.kernels() == {"sdpa"}:
            yield
            return
        from diffusers.models.transformers import transformer_wan as wan

        original = wan.dispatch_attention_fn
        wan.dispatch_attention_fn = _router(original, approx, routes)
        try:
            yield
        finally:
            wan.dispatch_attention_fn = original


@cache
def _router(original: Any, approx: str | None, routes: Routes) -> Any:
    """diffusers' ``dispatch_attention_fn`` with unmasked CUDA calls routed: self-attention to
    the ``approx`` kernel if any, the rest by ``routes`` (flash-attn-4 or SDPA); masks, SP's
    parallel_config and anything else to ``original``."""

    def dispatch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                 scale: float | None = None, **kwargs: Any) -> torch.Tensor:
        if (attn_mask is None and dropout_p == 0.0 and not is_causal and scale is None
                and kwargs.get("parallel_config") is None and query.is_cuda
                and query.dtype in (torch.bfloat16, torch.float16)):
            own = query.shape == key.shape == value.shape
            if own and approx is not None:
                return cudnn_fp8_attention.attend(query, key, value)
            kernel = routes.kernel("self" if own else "cross", query.shape[1], key.shape[1], query.shape[2],
                                   query.shape[3])
            if kernel == "fa4" and fa4_attention.fits(query, key, value):
                return fa4_attention.attend(query, key, value)
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, **kwargs)

    return dispatch


def _is_wan(transformer: torch.nn.Module) -> bool:
    return type(transformer).__module__.endswith("transformer_wan")


def check(backend: str, transformer: torch.nn.Module, device: torch.device,
          dtype: torch.dtype | None = None) -> None:
    """FlagError naming ``--attention`` where ``backend`` cannot serve this model on ``device``
    (CPU, not sm90, the gpu extra missing, not Wan, a head dim the kernel does not take, a
    ``dtype`` it does not take); exact and sdpa always can."""
    if backend in ("exact", "sdpa"):
        return
    flag = f"--attention {backend}"
    if not _is_wan(transformer):
        raise FlagError(f"{flag}: serves Wan models only (this transformer is {type(transformer).__name__}); "
                        "use --attention exact")
    if dtype is not None and dtype not in HALF:
        raise FlagError(f"{flag}: the kernel takes bfloat16 or float16, this model computes in "
                        f"{str(dtype).removeprefix('torch.')} (--dtype bfloat16 serves it in half "
                        "precision); use --attention exact")
    why = available(NEEDS[backend], device)
    if why is not None:
        raise FlagError(f"{flag}: {why}; use --attention exact")
    head_dim = int((getattr(transformer, "config", {}) or {}).get("attention_head_dim", 0))
    dims = HEAD_DIMS.get(backend, tuple(range(8, 257, 8)))
    if head_dim not in dims:
        raise FlagError(f"{flag}: the kernel takes head dims {list(dims)}, this model has {head_dim}; "
                        "use --attention exact")


def load_routes(backend: str, transformer: torch.nn.Module, device: torch.device, heads: int,
                head_dim: int, dtype: torch.dtype) -> Routes:
    """The exact routes for this model (kept for ``chosen``): measured on a GPU where
    flash-attn-4 runs, else SDPA with the reason; any failure falls back to SDPA."""
    global _measured
    if backend in ("sdpa", "fa4"):
        _measured = Routes()
        return routes_for(backend)
    why = available("fa4", device)
    if not _is_wan(transformer):
        routes = Routes(why="flash-attn-4 is routed for Wan's attention only")
    elif why is not None:
        routes = Routes(why=f"flash-attn-4 not tried: {why}")
    else:
        try:
            routes = measured_routes(heads, head_dim, dtype, device)
        except Exception as e:  # noqa: BLE001 - the fallback is SDPA, and the report says why
            routes = Routes(why=f"measuring the exact kernels failed ({type(e).__name__}: {e}); SDPA")
    _measured = routes
    return routes


def report(transformer: torch.nn.Module, device: torch.device, dtype: torch.dtype | None,
           backend: str = "exact") -> dict[str, Any]:
    """What runs for this transformer's heads on ``device`` (``check`` first): SDPA's kernel
    (asked of torch's own dispatcher, ``_fused_sdp_choice``, on empty inputs of the model's
    shape), the exact routes and why, and with an approximate ``backend`` its kernel and error.
    ``backend`` / ``cross_attention``: the kernels of Wan's self- and cross-attention at 32,760
    tokens (SDPA's name where SDPA runs)."""
    config = getattr(transformer, "config", {}) or {}
    heads = int(config.get("num_attention_heads", 1))
    head_dim = int(config.get("attention_head_dim", 64))
    if dtype is None:  # the checkpoint's: the dtype most of the resident weights have (not the fp32 norms)
        counts: Counter[torch.dtype] = Counter()
        for t in transformer.parameters():
            if t.is_floating_point() and t.element_size() > 1:
                counts[t.dtype] += t.numel()
        dtype = counts.most_common(1)[0][0] if counts else torch.float32
    check(backend, transformer, device, dtype)
    q = torch.empty(1, heads, 1024, head_dim, device=device, dtype=dtype)
    with sdpa_kernel(list(ORDER), set_priority=True):
        picked = SDPBackend(torch._fused_sdp_choice(q, q, q)).name.lower()
    routes = load_routes(backend, transformer, device, heads, head_dim, dtype)

    def name(kind: str) -> str:
        tokens, text = MAIN
        kernel = routes.kernel(kind, tokens, tokens if kind == "self" else text, heads, head_dim)
        return picked if kernel == "sdpa" else kernel

    out = {"backend": name("self"), "cross_attention": name("cross"), "sdpa": picked,
           "order": [b.name.lower() for b in ORDER], "heads": heads, "head_dim": head_dim,
           "dtype": str(dtype).removeprefix("torch."), "why": WHY + (f"; {routes.why}" if routes.why else ""),
           "routes": routes.as_dict()}
    if (fa4_cache := fa4_attention.cache_facts()) is not None:
        out["fa4_cache"] = fa4_cache
    if backend in APPROXIMATE:
        out.update(backend=APPROXIMATE[backend], approximate=True, error=ERROR[backend])
    return out
