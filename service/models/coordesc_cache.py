"""inductor's tuning choices taken from its cache on a restart (torch 2.9 to 2.12).

FP8 weights compile with inductor's coordinate-descent tuning (``compiled.FP8_INDUCTOR_OPTIONS``).
When a later start loads a generated kernel from inductor's caches, it asks the autotune cache
which config an earlier start chose. torch before 2.13 skips that question for a kernel compiled
with a single config, and where it does ask, forgets that the answer came from the tuning; either
way the kernel's first call tunes it again (pytorch/pytorch#172819). On an H100 that was 14.1 s of
a 43.9 s FP8 restart at 12 Wan-14B layers (loadtest/results/h100-startup-2026-12-07-12-fp8.json);
patched, 0-4.9 s of three (h100-startup-2026-12-07-12-fp8-patched*.json).
torch 2.13 asks for every kernel and keeps the flag. ``apply`` puts that behaviour into the
method where the torch running is older and has what the method uses; elsewhere it does nothing.

The same releases re-benchmark a kernel whose cache answered: ``_dynamic_scale_rblock`` adds
halved-RBLOCK configs to the one config the recheck kept, and the first call benchmarks them;
and a cached choice the halving found is never compiled. 2.13 skips the halving on a hit and
compiles any cached choice (pytorch/pytorch#181789); ``apply`` does both. A reduction with a
single heuristic config is never looked up in the autotune cache, so its halving is benchmarked
in every process on 2.13 too (#189121): not covered here. Every bf16 restart on an H100 spent
1.4-2.0 s in ``CachingAutotuner.benchmark_all_configs`` (h100-startup-2026-12-07-*-s7.json);
which of the two cases that was is not measured yet.
"""

from __future__ import annotations

from typing import Any

BUGGY = ((2, 9), (2, 12))  # the torch releases (major, minor) patched, both included
applied: str | None = None  # what apply() did, for the compile facts (None: nothing)
_torch_own: Any = None  # the method replaced: taken where the cache's answer has another shape
_torch_scale: Any = None  # torch's own ``_dynamic_scale_rblock``, called where the cache missed


def needs_patch(version: str) -> bool:
    """Whether torch ``version`` ("2.11.0+cu130") re-tunes on a cache hit."""
    parts = version.split("+")[0].split(".")
    try:
        release = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return False
    return BUGGY[0] <= release <= BUGGY[1]


def apply() -> str | None:
    """Patch ``CachingAutotuner.recheck_autotune_cache`` (and ``_dynamic_scale_rblock``, where
    it exists) once per process where ``needs_patch``; returns what was done (or None: nothing
    needed or nothing safe to do)."""
    global applied, _torch_own, _torch_scale
    if applied is not None:
        return applied
    import torch

    if not needs_patch(torch.__version__):
        return None
    try:
        from torch._inductor.runtime import triton_heuristics as th
    except ImportError:  # no triton: nothing is tuned
        return None
    uses = ("check_autotune_cache", "triton_config_to_hashable", "dynamo_timed", "CachingAutotuner")
    if not all(hasattr(th, name) for name in uses) or not hasattr(
            th.CachingAutotuner, "recheck_autotune_cache"):
        return None  # not the code this was written against: leave torch's own
    _torch_own = th.CachingAutotuner.recheck_autotune_cache
    th.CachingAutotuner.recheck_autotune_cache = _recheck
    done = ["recheck_autotune_cache"]
    if callable(getattr(th.CachingAutotuner, "_dynamic_scale_rblock", None)):
        _torch_scale = th.CachingAutotuner._dynamic_scale_rblock
        th.CachingAutotuner._dynamic_scale_rblock = _scale_rblock_on_a_miss
        done.append("_dynamic_scale_rblock")
    applied = f"{', '.join(done)} (torch {torch.__version__})"
    return applied


def _scale_rblock_on_a_miss(self: Any) -> None:
    """torch's RBLOCK halving, unless the autotune cache answered for this kernel: its cached
    config is the one an earlier start chose among the halved ones too."""
    info = getattr(self, "autotune_cache_info", None)
    if isinstance(info, dict) and info.get("autotune_cache_state") == "hit":
        return None
    return _torch_scale(self)


def _recheck(self: Any, reload_kernel_from_src: Any) -> None:
    """A statically launchable kernel loaded from inductor's cache: narrow its compiled configs
    to the one the autotune cache holds, with the cache's word on whether the tuning found it
    (so ``run`` does not tune it again); compile that config if it is not among them, whatever
    found it (the tuning or the RBLOCK halving)."""
    from torch._inductor.runtime import triton_heuristics as th

    assert self.is_statically_launchable()
    compiled = [result.config for result in self.compile_results]
    answer = th.check_autotune_cache(compiled, self.filename, self.inductor_meta)
    if not (isinstance(answer, tuple) and len(answer) == 3):  # not the torch this was written for
        return _torch_own(self, reload_kernel_from_src)
    cached, _, self.autotune_cache_info = answer
    if len(cached) != 1:  # a miss: the kernel autotunes as on a first start
        return
    best = cached[0]
    tuned = getattr(best, "found_by_coordesc", False)
    key = th.triton_config_to_hashable(best)
    match = next((r for r in self.compile_results if th.triton_config_to_hashable(r.config) == key), None)
    if match is not None:
        match.config.found_by_coordesc = tuned
        self.compile_results = [match]
    else:  # chosen by the tuning or by the RBLOCK halving, never compiled ahead: compile it now
        with th.dynamo_timed("CachingAutotuner.slow_precompile_config"):
            if self.fn.fn is None:
                self.fn = reload_kernel_from_src().fn
            self.compile_results = [self._precompile_config(best)]
