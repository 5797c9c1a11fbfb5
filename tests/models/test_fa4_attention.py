"""flash-attn-4's disk cache of compiled kernels: on under $DLOSERVE_CACHE/fa4 unless the
environment says otherwise (the kernel itself needs a Hopper GPU: checked on the device)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.models import attention_routes, fa4_attention
from service.models.fa4_attention import CACHE_DIR, CACHE_ON


def test_the_cache_goes_on_beside_ours_where_nothing_is_set(no_fa4_cache_env: Path) -> None:
    assert fa4_attention.keep_cache() == str(no_fa4_cache_env / "fa4")
    assert os.environ[CACHE_ON] == "1" and os.environ[CACHE_DIR] == str(no_fa4_cache_env / "fa4")


def test_the_environment_keeps_its_word(no_fa4_cache_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ON, "0")
    assert fa4_attention.keep_cache() is None
    assert CACHE_DIR not in os.environ
    monkeypatch.setenv(CACHE_ON, "1")
    monkeypatch.setenv(CACHE_DIR, "/elsewhere")
    assert fa4_attention.keep_cache() == "/elsewhere"


def test_the_import_check_sets_the_switch_before_importing(no_fa4_cache_env: Path) -> None:
    """The wheel reads the switch at its import, which ``available`` makes first."""
    assert attention_routes.import_error("fa4") is not None  # no gpu extra on this CPU install
    assert os.environ[CACHE_ON] == "1"
    assert fa4_attention.cache_facts() is None  # nothing imported: nothing to report
