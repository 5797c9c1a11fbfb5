"""The checks of a request that depend on the served model and its settings, in one place.

The ingress runs them before it accepts a request (a 422 naming the field) and every rank
runs them again before it takes one. One function for both, so nothing the edge accepts is
refused on a rank: a refusal there costs a round trip, and used to cost a rebuild of the
whole rank group (an error that did not unpickle read as the rank's death).
"""

from __future__ import annotations

from typing import Any

from service.config.cache import CacheSpec

from .lora_ref import LoraRef
from .request import GenerationRequest, RequestError

CACHE_FAMILIES = ("wan-t2v",)  # one block list, diffusers' cache hooks know its blocks


def cache_unsupported(adapter: Any) -> str:
    """Why step caches cannot run on this model and layout ("" when they can)."""
    if len(getattr(adapter, "experts", ())) > 1:
        # Two experts (Wan2.2 A14B): diffusers' hooks and their residual state would sit on
        # one expert only, and the switch between them is a decision of its own. The offload
        # can stop each expert's forward early (its decision points are the first two blocks
        # of the expert that runs), but the model side is not wired up.
        return (f"step caches are not supported on a two-expert model ({adapter.family}: "
                f"{' + '.join(adapter.experts)}) yet")
    if adapter.family not in CACHE_FAMILIES or len(adapter.block_attrs) != 1:
        return f"step caches are not supported for {adapter.family} yet (Wan T2V has them)"
    if adapter.sequence_parallel > 1:
        # Each SP rank sees 1/S of the tokens, so a residual test would decide per rank, and
        # a skipped block makes no attention all-to-all: the ranks would fall out of step.
        return "step caches do not run with --sequence-parallel-size > 1 yet"
    return ""


def check_loras(refs: tuple[LoraRef, ...], adapter: Any, budget_bytes: int) -> None:
    """RequestError for what a request may not ask of this model's adapters."""
    if not refs:
        return
    if budget_bytes <= 0:
        raise RequestError("loras", "adapters are off on this server (--lora-cache-gb 0)")
    if len(getattr(adapter, "experts", ())) > 1:
        raise RequestError("loras", f"adapters are not supported on a two-expert model ({adapter.family}: "
                                    f"{' + '.join(adapter.experts)}) yet")
    for i, ref in enumerate(refs):
        if not ref.source:
            raise RequestError(f"loras[{i}].name", f"adapter {ref.name!r} is not registered")
        if ref.expert not in (None, "both"):
            raise RequestError(f"loras[{i}].expert", f"{adapter.family} has one transformer: "
                                                     f"expert must be 'both', got {ref.expert!r}")


def check_request(adapter: Any, req: GenerationRequest, lora_budget_bytes: int,
                  default_cache: CacheSpec | None) -> None:
    """Every model-dependent rule: the family's (``adapter.validate``), the adapters', the
    step cache's (the request's, or the server default it takes). RequestError names the field."""
    adapter.validate(req)
    check_loras(req.loras, adapter, lora_budget_bytes)
    spec = req.cache if req.cache is not None else (default_cache or CacheSpec())
    if spec.enabled:
        why = cache_unsupported(adapter)
        if why:
            raise RequestError("cache.method", why)
