"""Fixtures of the model tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.models.fa4_attention import CACHE_DIR, CACHE_ON


@pytest.fixture
def no_fa4_cache_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """flash-attn-4's cache variables unset and ``$DLOSERVE_CACHE`` a temporary folder; both
    variables put back as they were after the test (setenv records the original, so the later
    delenv and whatever the test sets are undone: the fa4 import check sets them)."""
    for name in (CACHE_ON, CACHE_DIR):
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)
    monkeypatch.setenv("DLOSERVE_CACHE", str(tmp_path))
    return tmp_path
