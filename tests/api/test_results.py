"""Results storage through fsspec: a local folder and an S3 bucket behave the same."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.api.records import JobRecord, JobStatus
from service.api.results import ResultStorage, open_storage
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
