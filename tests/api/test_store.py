"""The job store's retention and persistence, on a temp folder (fast)."""

from __future__ import annotations

import time
from pathlib import Path

from service.api.store import JobStore


def rec(i: int, status: str = "queued") -> dict:
    return {"id": f"video_{i}", "status": status, "created_at": 1000 + i}


def test_keeps_the_newest_max_jobs_finished_and_never_drops_live_ones(tmp_path: Path) -> None:
    s = JobStore(tmp_path, max_jobs=3)
    for i in range(5):
        s.put(rec(i))
    for i in range(5):
        s.finish(f"video_{i}", b"mp4-%d" % i, status="completed", completed_at=int(time.time()) + i)
    assert [r["id"] for r in s.list()] == ["video_2", "video_3", "video_4"]
    assert not (tmp_path / "video_0.mp4").exists() and (tmp_path / "video_4.mp4").read_bytes() == b"mp4-4"
    live = JobStore(tmp_path / "live", max_jobs=1)
    for i in range(3):
        live.put(rec(i))  # queued jobs are never pruned
    assert len(live.list()) == 3


def test_ttl_expiry_and_reload_from_disk(tmp_path: Path) -> None:
    s = JobStore(tmp_path, ttl_s=0.0)
    s.put(rec(1))
    s.finish("video_1", b"x", status="completed", completed_at=int(time.time()) - 5)
    s.put(rec(2))  # any write prunes
    assert s.get("video_1") is None and s.content_path("video_1") is None
    s.update("video_2", status="in_progress", progress=50)
    again = JobStore(tmp_path)
    assert again.get("video_2")["progress"] == 50
    assert again.get("../../etc/passwd") is None
    assert again.delete("video_2") and again.get("video_2") is None


def test_restart_fails_jobs_left_unfinished(tmp_path: Path) -> None:
    s = JobStore(tmp_path)
    s.put(rec(1))
    s.put(rec(2, "in_progress"))
    s.put(rec(3))
    s.finish("video_3", b"x", status="completed")
    after = JobStore(tmp_path)  # a new process on the same folder
    assert after.fail_unfinished("interrupted", "restarted") == 2
    assert [after.get(f"video_{i}")["status"] for i in (1, 2, 3)] == ["failed", "failed", "completed"]
    assert after.get("video_1")["error"]["code"] == "interrupted"
