"""The HTTP service end to end: real Serve, real DP=2 group, real sockets on 127.0.0.1."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray

from service.models.request import GenerationRequest
from tests.api.conftest import MAX_WAIT_MS, QUEUE_SIZE, wait_final, wait_ready


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/videos", json=body, timeout=30)


def waves_of(url: str, ids: list[str]) -> list[dict]:
    return [w for w in httpx.get(f"{url}/v1/waves").json() if set(w["ids"]) & set(ids)]


def test_health_ready_openapi(app_url: str) -> None:
    assert httpx.get(f"{app_url}/healthz").json() == {"status": "ok"}
    ready = wait_ready(app_url, 60)
    assert ready["state"] == "ready" and ready["dp_size"] == 2 and len(ready["workers"]) == 2
    spec = httpx.get(f"{app_url}/openapi.json").json()
    assert "/v1/videos" in spec["paths"] and "/v1/videos/{video_id}/content" in spec["paths"]


def test_four_compatible_requests_run_as_two_waves_bitwise_equal(app_url: str, resident) -> None:  # noqa: ANN001
    seeds = [101, 102, 103, 104]
    with ThreadPoolExecutor(4) as pool:
        rs = list(pool.map(lambda s: post(app_url, {"prompt": f"fox {s}", "seed": s}), seeds))
    assert all(r.status_code == 202 for r in rs), [r.text for r in rs]
    ids = [r.json()["id"] for r in rs]
    assert all(r.json()["status"] == "queued" and r.json()["object"] == "video" for r in rs)
    finals = [wait_final(app_url, i) for i in ids]
    assert [f["status"] for f in finals] == ["completed"] * 4, finals
    waves = waves_of(app_url, ids)
    assert sorted(w["size"] for w in waves) == [2, 2], waves
    assert sorted(f["dp_rank"] for f in finals) == [0, 0, 1, 1]
    for s, vid in zip(seeds, ids, strict=True):
        r = httpx.get(f"{app_url}/v1/videos/{vid}/content")
        assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
        assert r.content == resident.generate(GenerationRequest(prompt=f"fox {s}", seed=s))


def test_keys_never_share_a_wave_and_lone_request_waits_max_wait(app_url: str) -> None:
    t0 = time.time()
    a = post(app_url, {"prompt": "five frames", "num_frames": 5}).json()["id"]
    b = post(app_url, {"prompt": "nine frames", "num_frames": 9}).json()["id"]
    finals = [wait_final(app_url, i) for i in (a, b)]
    assert [f["status"] for f in finals] == ["completed"] * 2
    assert finals[0]["seed"] != finals[1]["seed"]  # no seed given: a fresh one each, reported
    waves = waves_of(app_url, [a, b])
    assert [w["size"] for w in waves] == [1, 1] and waves[0]["key"] != waves[1]["key"]
    assert all(w["reason"] == "timeout" for w in waves)
    assert waves[0]["started_at"] - t0 >= MAX_WAIT_MS / 1000 - 0.05


BAD = [
    ({"prompt": "x", "colour": "red"}, "colour"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "   "}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "width": 33}, "width"),
    ({"prompt": "x", "size": "big"}, "size"),
    ({"prompt": "x", "num_frames": 6}, "num_frames"),
    ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps"),
    ({"prompt": "x", "num_inference_steps": 101}, "num_inference_steps"),
    ({"prompt": "x", "guidance_scale": -1}, "guidance_scale"),
    ({"prompt": "x", "seed": "abc"}, "seed"),
    ({"prompt": "x", "size": "4096x4096"}, "width"),
    ({"prompt": "x", "model": "sora-2"}, "model"),
]


@pytest.mark.parametrize(("body", "field"), BAD, ids=[f for _, f in BAD])
def test_malformed_input_is_422_naming_the_field_and_never_reaches_a_worker(
    app_url: str, body: dict, field: str
) -> None:
    before = httpx.get(f"{app_url}/readyz").json()["waves_run"]
    n_jobs = len(httpx.get(f"{app_url}/v1/videos?limit=100").json()["data"])
    r = post(app_url, body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == field, r.json()
    assert httpx.get(f"{app_url}/readyz").json()["waves_run"] == before
    assert len(httpx.get(f"{app_url}/v1/videos?limit=100").json()["data"]) == n_jobs


def test_unreadable_bodies_are_422(app_url: str) -> None:
    r = httpx.post(f"{app_url}/v1/videos", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 422
    files = {"input_reference": ("a.png", b"\x89PNG", "image/png")}
    r = httpx.post(f"{app_url}/v1/videos", data={"prompt": "x"}, files=files)
    assert r.status_code == 422 and r.json()["error"]["param"] == "input_reference"


def test_full_queue_answers_429_with_retry_after(app_url: str) -> None:
    # A long wave holds the group; meanwhile QUEUE_SIZE + 2 posts arrive at once.
    slow = post(app_url, {"prompt": "slow", "num_inference_steps": 40}).json()["id"]
    while httpx.get(f"{app_url}/v1/videos/{slow}").json()["status"] == "queued":
        time.sleep(0.05)
    with ThreadPoolExecutor(4) as pool:
        rs = list(pool.map(lambda i: post(app_url, {"prompt": f"q{i}", "seed": i}), range(QUEUE_SIZE + 2)))
    assert httpx.get(f"{app_url}/v1/videos/{slow}").json()["status"] == "in_progress"
    accepted = [r for r in rs if r.status_code == 202]
    refused = [r for r in rs if r.status_code != 202]
    assert len(accepted) == QUEUE_SIZE and len(refused) == 2, [r.status_code for r in rs]
    assert all(r.status_code == 429 and int(r.headers["retry-after"]) >= 1 for r in refused)
    assert refused[0].json()["error"]["code"] == "queue_full"
    for r in accepted + [httpx.get(f"{app_url}/v1/videos/{slow}")]:
        assert wait_final(app_url, r.json()["id"])["status"] == "completed"


def test_killed_worker_fails_its_wave_then_group_rebuilds(app_url: str) -> None:
    ready = wait_ready(app_url, 60)
    vid = post(app_url, {"prompt": "doomed", "num_inference_steps": 60}).json()["id"]
    end = time.monotonic() + 60
    while httpx.get(f"{app_url}/v1/videos/{vid}").json()["progress"] == 0:
        assert time.monotonic() < end
        time.sleep(0.05)
    t_kill = time.monotonic()
    ray.kill(ray.get_actor(ready["workers"][1], namespace=ready["namespace"]))
    v = wait_final(app_url, vid, timeout=60)
    assert v["status"] == "failed" and "rank 1" in v["error"]["message"], v
    assert time.monotonic() - t_kill < 30
    during = httpx.get(f"{app_url}/readyz")  # a rebuild takes seconds: readiness says so
    assert during.status_code == 503 and during.json()["state"] in ("broken", "rebuilding")
    assert "rank 1" in during.json()["last_error"]
    after = wait_ready(app_url, 120)
    assert after["generation"] == ready["generation"] + 1 and after["rebuilds"] >= 1
    ok = post(app_url, {"prompt": "after the rebuild", "seed": 9}).json()["id"]
    assert wait_final(app_url, ok)["status"] == "completed"


def test_delete_and_list(app_url: str) -> None:
    vid = post(app_url, {"prompt": "to delete"}).json()["id"]
    wait_final(app_url, vid)
    listed = httpx.get(f"{app_url}/v1/videos", params={"limit": 2}).json()
    assert listed["object"] == "list" and listed["data"][0]["id"] == vid and listed["has_more"]
    r = httpx.delete(f"{app_url}/v1/videos/{vid}")
    assert r.json() == {"id": vid, "object": "video.deleted", "deleted": True}
    assert httpx.get(f"{app_url}/v1/videos/{vid}").status_code == 404
    assert httpx.get(f"{app_url}/v1/videos/{vid}/content").status_code == 404
