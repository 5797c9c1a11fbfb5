"""The job table's retention, persistence and final-state rule, on a temp folder (fast)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from service.api.records import JobRecord, JobStatus
from service.api.results import ResultStorage
from service.api.store import JobTable, StoreLocked


def rec(i: int, status: str = "queued", group: str = "g1", owner: str | None = None) -> JobRecord:
    return JobRecord(f"video_{i}", 1000 + i, JobStatus(status), dp_group=group, owner=owner)


def table(path: Path, **kw) -> JobTable:  # noqa: ANN003
    return JobTable(ResultStorage(str(path)), **kw)


def finish_with_video(t: JobTable, i: int, at: int) -> None:
    t.storage.write_video(f"video_{i}", b"mp4-%d" % i)
    assert t.finish(f"video_{i}", status="completed", completed_at=at)


def test_keeps_the_newest_max_jobs_finished_and_never_drops_live_ones(tmp_path: Path) -> None:
    s = table(tmp_path, max_jobs=3)
    for i in range(5):
        s.put(rec(i))
    for i in range(5):
        finish_with_video(s, i, int(time.time()) + i)
    assert [r.id for r in s.list()] == ["video_2", "video_3", "video_4"]
    assert not (tmp_path / "video_0.mp4").exists() and (tmp_path / "video_4.mp4").read_bytes() == b"mp4-4"
    live = table(tmp_path / "live", max_jobs=1)
    for i in range(3):
        live.put(rec(i))  # queued jobs are never pruned
    assert len(live.list()) == 3


def test_ttl_expiry_and_reload_from_storage(tmp_path: Path) -> None:
    s = table(tmp_path, ttl_s=0.0)
    s.put(rec(1))
    finish_with_video(s, 1, int(time.time()) - 5)
    s.put(rec(2))  # any write prunes
    assert s.get("video_1") is None and s.storage.video_path("video_1") is None
    s.update("video_2", status="in_progress", progress=50)
    s.update("video_2", persist=False, progress=60)  # progress alone stays in memory
    again = table(tmp_path)
    assert again.get("video_2").progress == 50
    assert again.get("../../etc/passwd") is None and not again.delete("../../etc/passwd")
    assert again.delete("video_2") and again.get("video_2") is None


def test_a_final_record_stays_final_and_groups_fail_alone(tmp_path: Path) -> None:
    s = table(tmp_path)
    s.put(rec(1))
    s.put(rec(2, "in_progress"))
    s.put(rec(3, group="g2"))
    assert s.live_groups() == {"g1", "g2"} and sorted(s.unfinished("g1")) == ["video_1", "video_2"]
    assert s.fail(s.unfinished("g1"), "dp_group_lost", "gone") == 2
    assert s.get("video_1").error["code"] == "dp_group_lost" and s.get("video_3").status is JobStatus.QUEUED
    # the lost group answers late: neither its update nor its finish revives the job
    assert s.update("video_2", status=JobStatus.IN_PROGRESS, progress=90).status is JobStatus.FAILED
    assert not s.finish("video_2", status=JobStatus.COMPLETED)
    assert table(tmp_path).get("video_2").status is JobStatus.FAILED
    with pytest.raises(ValueError, match="final status"):
        s.finish("video_3", status=JobStatus.IN_PROGRESS)
    assert s.get("video_3").status is JobStatus.QUEUED  # a refused finish changes nothing


def test_pages_by_owner(tmp_path: Path) -> None:
    s = table(tmp_path)
    for i in range(5):
        s.put(rec(i, owner="a" if i % 2 else "b"))
    page, more = s.page("b", True, None, 2, "asc")
    assert [r.id for r in page] == ["video_0", "video_2"] and more
    page, more = s.page("b", True, "video_2", 2, "asc")
    assert [r.id for r in page] == ["video_4"] and not more
    newest_first = [f"video_{i}" for i in range(4, -1, -1)]
    assert [r.id for r in s.page(None, False, None, 10, "desc")[0]] == newest_first


def test_records_round_trip_and_read_what_a_newer_version_wrote(tmp_path: Path) -> None:
    r = rec(1).with_(timings={"queue_s": 1.5}, error={"code": "x", "message": "y"})
    assert JobRecord.from_json(r.to_json()) == r
    newer = {**r.to_json(), "quota_class": "gold"}
    assert JobRecord.from_json(newer).extra == {"quota_class": "gold"}


def test_a_results_folder_has_one_live_owner(tmp_path: Path) -> None:
    first = table(tmp_path, exclusive=True)
    with pytest.raises(StoreLocked) as e:
        table(tmp_path, exclusive=True)
    assert f"pid {__import__('os').getpid()}" in str(e.value)
    del first


def test_the_folder_lock_is_private_whatever_the_umask(tmp_path: Path) -> None:
    import stat

    old = os.umask(0o022)
    try:
        t = table(tmp_path / "new", exclusive=True)
        assert stat.S_IMODE((tmp_path / "new" / ".lock").stat().st_mode) == 0o600
        assert (tmp_path / "new" / ".lock").read_text() == f"pid {os.getpid()}"
        t._lock_file.close()
        (tmp_path / "old").mkdir()
        (tmp_path / "old" / ".lock").write_text("pid 1 and more from before")  # an older version's, 0644
        t = table(tmp_path / "old", exclusive=True)
        assert stat.S_IMODE((tmp_path / "old" / ".lock").stat().st_mode) == 0o600
        assert (tmp_path / "old" / ".lock").read_text() == f"pid {os.getpid()}"
        t._lock_file.close()
    finally:
        os.umask(old)
