"""Results storage through fsspec: a local folder and an S3 bucket behave the same."""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from service.api.records import JobRecord, JobStatus
from service.api.results import ResultStorage, StorageError, open_storage
from service.api.store import JobTable


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> ResultStorage:
    if request.param == "local":
        return ResultStorage(str(tmp_path / "results"))
    s3 = request.getfixturevalue("s3_server")
    return ResultStorage(f"s3://{s3['bucket']}/{tmp_path.name}", s3["storage_options"])


def test_records_and_videos_round_trip(storage: ResultStorage) -> None:
    t = JobTable(storage)
    t.put(JobRecord("video_a", 1, dp_group="g"))
    big = bytes(range(256)) * 9000  # over one 1 MiB chunk
    storage.write_video("video_a", big)
    assert t.finish("video_a", status=JobStatus.COMPLETED)
    again = JobTable(ResultStorage(storage.url, _options(storage)))  # a restarted store
    assert again.get("video_a").status is JobStatus.COMPLETED
    assert storage.has_video("video_a") and storage.size("video_a.mp4") == len(big)
    assert b"".join(storage.chunks("video_a.mp4")) == big
    assert (storage.video_path("video_a") is not None) == storage.is_local
    assert again.delete("video_a") and not storage.has_video("video_a")
    assert storage.read_records() == []
    assert not storage.has_video("../video_a")


def _options(storage: ResultStorage) -> dict:
    fs = storage.fs
    return {} if storage.is_local else {"endpoint_url": fs.endpoint_url, "key": fs.key, "secret": fs.secret,
                                        "client_kwargs": fs.client_kwargs}


def test_an_unreachable_url_names_itself() -> None:
    with pytest.raises(ValueError, match="nosuchproto://x"):
        open_storage("nosuchproto://x")


def _mount_tmpfs(folder: Path) -> bool:
    try:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(folder)],
                              capture_output=True).returncode == 0
    except OSError:  # no mount(8) here
        return False


@dataclass
class SmallDisk:
    """A folder whose writes fail for real once ``fill()`` is called: ``errno`` says how."""

    folder: Path
    errno: int
    fill: Callable[[], None]
    make_room: Callable[[], None]


@contextmanager
def small_disk(tmp_path: Path, free: int = 0) -> Iterator[SmallDisk]:
    """A 600 KiB tmpfs that ``fill()`` fills up to ``free`` bytes (ENOSPC), where this process
    may mount one (root); otherwise RLIMIT_FSIZE of ``free`` bytes on this process (EFBIG,
    with SIGXFSZ ignored so the write fails instead of killing it), lifted at the end.
    """
    folder = tmp_path / "small"
    folder.mkdir()
    if _mount_tmpfs(folder):
        filler = folder / "filler"

        def fill() -> None:
            with open(filler, "wb", buffering=0) as f:
                try:
                    while f.write(b"\0" * 4096):
                        pass
                except OSError:  # full
                    pass
            os.truncate(filler, max(0, filler.stat().st_size - free))

        try:
            yield SmallDisk(folder, errno.ENOSPC, fill, lambda: filler.unlink(missing_ok=True))
        finally:
            subprocess.run(["umount", "-l", str(folder)], check=False)
        return
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        yield SmallDisk(folder, errno.EFBIG,
                        lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (free, old_limit[1])),
                        lambda: resource.setrlimit(resource.RLIMIT_FSIZE, old_limit))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def test_a_failed_write_leaves_no_temp_file_and_says_why(tmp_path: Path) -> None:
    """A write past the free space: StorageError naming the errno, no ``.NAME.*.tmp`` left
    (one used to stay per failed write, filling the disk for good), the old object intact."""
    with small_disk(tmp_path, free=4096) as disk:
        folder, code = disk.folder, disk.errno
        storage = ResultStorage(str(folder))
        storage.put_bytes("video_a.json", b"{}")
        disk.fill()
        for _ in range(3):
            with pytest.raises(StorageError) as e:
                storage.put_bytes("video_a.json", b"x" * (64 << 10))
            assert e.value.errno == code and "video_a.json" in str(e.value)
        assert sorted(p.name for p in folder.iterdir() if p.name != "filler") == ["video_a.json"]
        assert storage.get_bytes("video_a.json") == b"{}"
        disk.make_room()
        storage.put_bytes("video_a.json", b"x" * (64 << 10))
        assert storage.size("video_a.json") == 64 << 10


def test_stale_temp_files_are_swept_by_the_folder_owner(tmp_path: Path) -> None:
    """Temp files of a killed writer go when the job store (the folder's one owner) starts;
    a young one may be another replica's write in progress and stays."""
    storage = ResultStorage(str(tmp_path / "r"))
    old, young = tmp_path / "r" / ".video_a.mp4.0123abcd.tmp", tmp_path / "r" / ".video_b.json.89abcdef.tmp"
    for p in (old, young):
        p.write_bytes(b"partial")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    JobTable(storage, exclusive=True)
    assert not old.exists() and young.exists()
