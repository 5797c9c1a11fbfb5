"""The patch of torch 2.9-2.12's re-tuning on a cache hit: which torch gets it, and what the
corrected recheck and RBLOCK halving do with the autotune cache's answer.

The kernels it acts on are Triton's (CUDA only); here the autotuner is a stand-in holding
configs with the fields torch hashes, and ``check_autotune_cache`` answers as the cache would.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from service.models import coordesc_cache


@pytest.mark.parametrize(("version", "patched"), [
    ("2.8.0", False), ("2.9.1+cu128", True), ("2.11.0+cu130", True), ("2.12.0", True),
    ("2.13.0+cpu", False), ("3.0.0", False), ("nightly", False)])
def test_which_torch_is_patched(version: str, patched: bool) -> None:
    assert coordesc_cache.needs_patch(version) is patched


def test_this_torch_is_left_alone() -> None:
    """The pinned torch (2.13) has the fix: nothing is replaced."""
    from torch._inductor.runtime import triton_heuristics as th

    before = th.CachingAutotuner.recheck_autotune_cache
    assert coordesc_cache.apply() is None
    assert th.CachingAutotuner.recheck_autotune_cache is before


def _config(block: int, tuned: bool = False) -> SimpleNamespace:
    return SimpleNamespace(kwargs={"XBLOCK": block}, num_warps=4, num_stages=1, found_by_coordesc=tuned)


def _tuner(configs: list[SimpleNamespace]) -> SimpleNamespace:
    tuner = SimpleNamespace(compile_results=[SimpleNamespace(config=c) for c in configs],
                            filename="k.py", inductor_meta={"coordinate_descent_tuning": True},
                            fn=SimpleNamespace(fn=object()), is_statically_launchable=lambda: True)
    tuner.precompiled = []
    tuner._precompile_config = lambda c: tuner.precompiled.append(c) or SimpleNamespace(config=c)
    return tuner


def _cache_answers(monkeypatch: pytest.MonkeyPatch, answer: list[Any]) -> None:
    from torch._inductor.runtime import triton_heuristics as th

    monkeypatch.setattr(th, "check_autotune_cache",
                        lambda configs, filename, meta: (
                            answer, None, {"autotune_cache_state": "hit" if answer else "miss"}))


def test_a_single_compiled_config_keeps_the_tunings_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11 skipped this case (one compiled config), so ``run`` tuned it again."""
    _cache_answers(monkeypatch, [_config(64, tuned=True)])
    tuner = _tuner([_config(64)])
    coordesc_cache._recheck(tuner, reload_kernel_from_src=None)
    assert [r.config.found_by_coordesc for r in tuner.compile_results] == [True]
    assert tuner.autotune_cache_info == {"autotune_cache_state": "hit"}


def test_the_cached_choice_is_narrowed_to(monkeypatch: pytest.MonkeyPatch) -> None:
    _cache_answers(monkeypatch, [_config(128, tuned=True)])
    tuner = _tuner([_config(64), _config(128), _config(256)])
    coordesc_cache._recheck(tuner, reload_kernel_from_src=None)
    kept = [(r.config.kwargs["XBLOCK"], r.config.found_by_coordesc) for r in tuner.compile_results]
    assert kept == [(128, True)]
    assert tuner.precompiled == []


@pytest.mark.parametrize("tuned", [True, False])  # the coordinate descent's choice, or the RBLOCK halving's
def test_a_choice_not_compiled_ahead_is_compiled(monkeypatch: pytest.MonkeyPatch, tuned: bool) -> None:
    _cache_answers(monkeypatch, [_config(512, tuned=tuned)])
    tuner = _tuner([_config(64), _config(128)])
    coordesc_cache._recheck(tuner, reload_kernel_from_src=None)
    assert [c.kwargs["XBLOCK"] for c in tuner.precompiled] == [512]
    assert [r.config.kwargs["XBLOCK"] for r in tuner.compile_results] == [512]


def test_a_miss_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    _cache_answers(monkeypatch, [])
    tuner = _tuner([_config(64), _config(128)])
    coordesc_cache._recheck(tuner, reload_kernel_from_src=None)
    assert [r.config.kwargs["XBLOCK"] for r in tuner.compile_results] == [64, 128]
    assert not any(r.config.found_by_coordesc for r in tuner.compile_results)


def test_another_answer_shape_goes_to_torchs_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch whose cache check answers otherwise gets its own method, not a crash at load."""
    seen = []
    monkeypatch.setattr(coordesc_cache, "_torch_own", lambda tuner, reload: seen.append(tuner))
    from torch._inductor.runtime import triton_heuristics as th

    monkeypatch.setattr(th, "check_autotune_cache", lambda configs, filename, meta: ([], None))
    tuner = _tuner([_config(64)])
    coordesc_cache._recheck(tuner, reload_kernel_from_src=None)
    assert seen == [tuner]


@pytest.mark.parametrize(("info", "halved"), [
    ({"autotune_cache_state": "hit"}, False), ({"autotune_cache_state": "miss"}, True),
    ({"autotune_cache_state": "only 1 config"}, True), (None, True)])
def test_rblock_is_halved_only_where_the_cache_did_not_answer(
        monkeypatch: pytest.MonkeyPatch, info: dict[str, str] | None, halved: bool) -> None:
    """torch before 2.13 halved a cache hit's RBLOCK again, so its first call benchmarked the
    added configs in every process (pytorch/pytorch#181789)."""
    calls = []
    monkeypatch.setattr(coordesc_cache, "_torch_scale", calls.append)
    tuner = SimpleNamespace(autotune_cache_info=info)
    coordesc_cache._scale_rblock_on_a_miss(tuner)
    assert calls == ([tuner] if halved else [])
