"""GET /v1/videos/{id}/preview's answers, from VideoService on the fake executor and an
in-process job store: 404 before the first step, the latest image with an ETag, 304 to it,
another key's 404, and the last step's image kept after the end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.requests import Request

from service.api.jobs import JobStore
from service.api.keys import key_hash, owner_id
from service.api.previews import preview_response
from service.api.records import JobStatus
from service.api.service import ServiceConfig, VideoService
from tests.fakes import FakeExecutor

BODY = {"prompt": "a red fox", "seed": 1, "num_inference_steps": 3}
MINE, THEIRS = owner_id(key_hash("sk-mine")), owner_id(key_hash("sk-theirs"))


def until(cond, timeout: float = 10.0) -> None:  # noqa: ANN001
    import time

    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.01)


def get(svc: VideoService, vid: str, owner: str | None, etag: str | None = None):  # noqa: ANN201
    headers = [(b"if-none-match", etag.encode())] if etag else []
    req = Request({"type": "http", "method": "GET", "path": f"/v1/videos/{vid}/preview", "headers": headers})
    return preview_response(svc, vid, owner, req)


@pytest.fixture
def service(demo_model: str, tmp_path: Path) -> Iterator[tuple[VideoService, FakeExecutor]]:
    ex = FakeExecutor((1,))
    store = JobStore(str(tmp_path), {}, 3600.0, 100, 30.0)
    cfg = ServiceConfig(model=demo_model, results_url=str(tmp_path),
                        api_key_hashes=[key_hash("sk-mine"), key_hash("sk-theirs")])
    svc = VideoService(cfg, executor=ex, store=store, node_id="node-1")
    try:
        yield svc, ex
    finally:
        svc.close()
        store.close()


def test_preview_changes_per_step_answers_304_and_is_the_owners_only(service) -> None:  # noqa: ANN001
    svc, ex = service
    rec = svc.create(dict(BODY), owner=MINE)
    ex.wait_assigned(rec.id)
    first = get(svc, rec.id, MINE)
    assert first.status_code == 404 and b"no preview yet" in first.body and b"preview_not_ready" in first.body

    ex.step(rec.id, 1, 3, preview=b"image of step 1")
    until(lambda: get(svc, rec.id, MINE).status_code == 200)
    one = get(svc, rec.id, MINE)
    assert one.body == b"image of step 1" and one.media_type == "image/webp"
    assert one.headers["x-preview-step"] == "1"
    etag = one.headers["etag"]
    assert get(svc, rec.id, MINE, etag).status_code == 304
    assert get(svc, rec.id, THEIRS).status_code == 404  # another key: as if it did not exist
    assert b"no video" in get(svc, rec.id, THEIRS).body

    ex.step(rec.id, 2, 3, preview=b"image of step 2")
    until(lambda: get(svc, rec.id, MINE, etag).status_code == 200)  # changed: the old ETag no longer matches
    two = get(svc, rec.id, MINE, etag)
    assert two.body == b"image of step 2" and two.headers["etag"] != etag
    assert svc.store.get(rec.id).progress == 66  # the preview event leaves progress to the plain one

    ex.step(rec.id, 3, 3, preview=b"image of step 3")
    ex.run(rec.id, steps=3)
    until(lambda: svc.store.get(rec.id).status is JobStatus.COMPLETED)
    until(lambda: get(svc, rec.id, MINE).body == b"image of step 3")  # the end keeps the last one
    svc.delete(rec.id, MINE)
    assert svc.store.preview(rec.id) is None


def test_a_job_that_ends_before_its_first_step_says_so(service) -> None:  # noqa: ANN001
    svc, ex = service
    rec = svc.create(dict(BODY), owner=MINE)
    ex.wait_assigned(rec.id)
    ex.finish(rec.id, error="RuntimeError: boom")
    until(lambda: svc.store.get(rec.id).status is JobStatus.FAILED)
    r = get(svc, rec.id, MINE)
    assert r.status_code == 404 and b"ended (failed) before its first denoising step" in r.body
