"""Background work below the serving threads' CPU priority (engine.priority)."""

from __future__ import annotations

import os
import threading

import pytest

from service.engine.priority import BACKGROUND_NICE, lower_this_thread, run_lowered


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_run_lowered_nices_its_thread_and_what_it_starts_not_the_caller() -> None:
    mine = _nice()
    want = min(19, mine + BACKGROUND_NICE)

    def work() -> tuple[int, int]:
        seen: list[int] = []
        child = threading.Thread(target=lambda: seen.append(_nice()))  # inherits its starter's
        child.start()
        child.join()
        return _nice(), seen[0]

    assert run_lowered(work, "t") == (want, want)
    assert _nice() == mine  # the caller's thread (the one that becomes the rank's) is untouched


def test_run_lowered_raises_the_work_error_on_the_caller() -> None:
    def fail() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        run_lowered(fail, "t")


def test_lower_this_thread_says_false_where_it_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise PermissionError("not here")

    monkeypatch.setattr(os, "setpriority", refuse)
    assert lower_this_thread() is False
