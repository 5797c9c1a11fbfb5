"""The HTTP service end to end: real Serve, real DP=2 group, real sockets on 127.0.0.1."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from service.models.request import GenerationRequest
from tests.api.conftest import QUEUE_SIZE, wait_final, wait_ready


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


def test_mixed_requests_share_the_allgather_group_and_match_resident(app_url: str, resident) -> None:  # noqa: ANN001
    """Four shapes, step counts and CFG settings at once: both ranks run, all bytes exact."""
    bodies = [
        {"prompt": "fox", "seed": 101, "num_inference_steps": 6},
        {"prompt": "owl", "seed": 102, "num_frames": 9, "num_inference_steps": 3},
        {"prompt": "cat", "seed": 103, "size": "48x32", "guidance_scale": 1.0},
        {"prompt": "eel", "seed": 104, "num_frames": 9, "size": "16x32"},
    ]
    with ThreadPoolExecutor(4) as pool:
        rs = list(pool.map(lambda b: post(app_url, b), bodies))
    assert all(r.status_code == 202 for r in rs), [r.text for r in rs]
    assert all(r.json()["status"] == "queued" and r.json()["object"] == "video" for r in rs)
    ids = [r.json()["id"] for r in rs]
    finals = [wait_final(app_url, i) for i in ids]
    assert [f["status"] for f in finals] == ["completed"] * 4, finals
    assert sorted({f["dp_rank"] for f in finals}) == [0, 1]
    records = waves_of(app_url, ids)
    assert len({r["key"] for r in records}) == 4 and all(r["scheduler"] == "continuous" for r in records)
    spans = [(r["started_at"], r["started_at"] + r["latency_s"]) for r in records]
    assert any(a[0] < b[1] and b[0] < a[1] for a in spans for b in spans if a is not b)  # overlapped
    for body, vid in zip(bodies, ids, strict=True):
        r = httpx.get(f"{app_url}/v1/videos/{vid}/content")
        assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
        w, h = (int(x) for x in body.pop("size", "32x32").split("x"))
        assert r.content == resident.generate(GenerationRequest(width=w, height=h, **body))


def test_sync_answers_the_mp4_and_lists_the_job(app_url: str, resident) -> None:  # noqa: ANN001
    body = {"prompt": "sync fox", "seed": 5}
    r = httpx.post(f"{app_url}/v1/videos/sync", json=body, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4", r.text
    assert r.content == resident.generate(GenerationRequest(**body))
    vid = r.headers["x-video-id"]
    assert httpx.get(f"{app_url}/v1/videos/{vid}").json()["status"] == "completed"
    form = httpx.post(f"{app_url}/v1/videos/sync", files={k: (None, str(v)) for k, v in body.items()},
                      timeout=120)
    assert form.status_code == 200 and form.content == r.content
    bad = httpx.post(f"{app_url}/v1/videos/sync", json={"prompt": "x", "width": 33})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "width"


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
    # Two long requests hold both ranks; meanwhile QUEUE_SIZE + 2 posts arrive at once.
    slow = [post(app_url, {"prompt": f"slow {i}", "num_inference_steps": 40}).json()["id"] for i in (1, 2)]
    while any(httpx.get(f"{app_url}/v1/videos/{s}").json()["status"] == "queued" for s in slow):
        time.sleep(0.05)
    with ThreadPoolExecutor(4) as pool:
        rs = list(pool.map(lambda i: post(app_url, {"prompt": f"q{i}", "seed": i}), range(QUEUE_SIZE + 2)))
    assert all(httpx.get(f"{app_url}/v1/videos/{s}").json()["status"] == "in_progress" for s in slow)
    accepted = [r for r in rs if r.status_code == 202]
    refused = [r for r in rs if r.status_code != 202]
    assert len(accepted) == QUEUE_SIZE and len(refused) == 2, [r.status_code for r in rs]
    assert all(r.status_code == 429 and int(r.headers["retry-after"]) >= 1 for r in refused)
    assert refused[0].json()["error"]["code"] == "queue_full"
    # The two held the ranks while the queue filled; the rest of their 40 steps shows nothing.
    held = [vid for vid in slow if not httpx.delete(f"{app_url}/v1/videos/{vid}").json()["deleted"]]
    for vid in [r.json()["id"] for r in accepted]:  # nothing accepted is lost
        assert wait_final(app_url, vid)["status"] == "completed"
    assert all(wait_final(app_url, vid)["status"] in ("cancelled", "completed") for vid in held)


def test_delete_and_list(app_url: str) -> None:
    ids = [post(app_url, {"prompt": f"to list {i}"}).json()["id"] for i in range(3)]
    for i in ids:
        wait_final(app_url, i)
    listed = httpx.get(f"{app_url}/v1/videos", params={"limit": 2}).json()
    assert listed["object"] == "list" and listed["has_more"]
    assert [v["id"] for v in listed["data"]] == ids[:0:-1]  # newest first
    rest = httpx.get(f"{app_url}/v1/videos", params={"limit": 1, "after": ids[1]}).json()
    assert rest["data"][0]["id"] == ids[0]
    vid = ids[-1]
    r = httpx.delete(f"{app_url}/v1/videos/{vid}")
    assert r.json() == {"id": vid, "object": "video.deleted", "deleted": True}
    assert httpx.get(f"{app_url}/v1/videos/{vid}").status_code == 404
    assert httpx.get(f"{app_url}/v1/videos/{vid}/content").status_code == 404


def test_timings_add_up_to_the_requests_latency(app_url: str) -> None:
    vid = post(app_url, {"prompt": "timed", "seed": 3, "num_inference_steps": 3}).json()["id"]
    v = wait_final(app_url, vid)
    t = v["timings"]
    stages = ["queue_s", "text_encode_s", "denoise_s", "decode_s", "encode_s", "store_s"]
    assert all(t[k] is not None and t[k] >= 0 for k in stages) and len(t["step_s"]) == 3, t
    assert sum(t["step_s"]) <= t["denoise_s"] + 1e-6
    latency = v["completed_at"] - v["created_at"]  # whole seconds, as the API reports them
    assert abs(sum(t[k] for k in stages) - latency) <= 1.5, (t, latency)


def test_delete_of_a_running_job_cancels_it_and_the_other_rank_is_exact(app_url: str, resident) -> None:  # noqa: ANN001
    body = {"prompt": "cancel me", "seed": 1, "num_inference_steps": 100, "num_frames": 17}
    long = post(app_url, body).json()["id"]
    beside_body = {"prompt": "beside", "seed": 2, "num_inference_steps": 12}
    beside = post(app_url, beside_body).json()["id"]
    end = time.monotonic() + 120
    while httpx.get(f"{app_url}/v1/videos/{long}").json()["progress"] < 1:
        assert time.monotonic() < end
        time.sleep(0.05)
    r = httpx.delete(f"{app_url}/v1/videos/{long}")
    assert r.status_code == 200 and r.json()["deleted"] is False
    final = wait_final(app_url, long)
    assert final["status"] == "cancelled" and final["error"]["code"] == "cancelled" and final["progress"] < 90
    assert wait_final(app_url, beside)["status"] == "completed"
    content = httpx.get(f"{app_url}/v1/videos/{beside}/content").content
    assert content == resident.generate(GenerationRequest(**beside_body))
    assert httpx.delete(f"{app_url}/v1/videos/{long}").json()["deleted"] is True


# -- HTTP semantics (what only the real proxy and app show) -------------------------------
@pytest.fixture(scope="module")
def done(app_url: str) -> str:
    """One completed video to read."""
    vid = post(app_url, {"prompt": "http semantics", "seed": 9, "num_inference_steps": 1}).json()["id"]
    assert wait_final(app_url, vid)["status"] == "completed"
    return vid


def test_every_405_names_the_methods_the_path_has(app_url: str) -> None:
    for method, path, want in (("PUT", "/v1/videos", {"GET", "POST"}),
                               ("PATCH", "/v1/videos/x", {"GET", "DELETE"}),
                               ("POST", "/healthz", {"GET", "HEAD"}), ("DELETE", "/readyz", {"GET", "HEAD"})):
        r = httpx.request(method, f"{app_url}{path}")
        assert r.status_code == 405, (method, path, r.status_code)
        allow = {m.strip() for m in r.headers["allow"].split(",")}
        assert want <= allow, (path, r.headers["allow"])
        assert r.json()["error"]["code"] == "http_405"


def test_head_answers_headers_only(app_url: str, done: str) -> None:
    for path in ("/healthz", "/readyz", f"/v1/videos/{done}/content"):
        get, head = httpx.get(f"{app_url}{path}"), httpx.head(f"{app_url}{path}")
        assert head.status_code == get.status_code == 200, (path, head.status_code)
        assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]
    mp4 = httpx.get(f"{app_url}/v1/videos/{done}/content").content
    assert httpx.head(f"{app_url}/v1/videos/{done}/content").headers["content-length"] == str(len(mp4))


def test_conditional_get_of_the_mp4_answers_304(app_url: str, done: str) -> None:
    url = f"{app_url}/v1/videos/{done}/content"
    first = httpx.get(url)
    etag = first.headers["etag"]
    assert etag and first.headers["cache-control"] == "private, no-cache" and "authorization" in \
        first.headers["vary"].lower()
    for tag in (etag, f"W/{etag}", f'"other", {etag}', "*"):
        again = httpx.get(url, headers={"If-None-Match": tag})
        assert again.status_code == 304 and again.content == b"" and again.headers["etag"] == etag, tag
    assert httpx.get(url, headers={"If-None-Match": '"stale"'}).content == first.content


def test_ranges_work_and_bad_ones_are_json_errors(app_url: str, done: str) -> None:
    url = f"{app_url}/v1/videos/{done}/content"
    whole = httpx.get(url).content
    part = httpx.get(url, headers={"Range": "bytes=0-9"})
    assert part.status_code == 206 and part.content == whole[:10]
    for value, status, code in (("bytes=abc", 400, "invalid_range"), ("items=0-1", 400, "invalid_range"),
                                ("bytes=9-3", 400, "invalid_range"),
                                (f"bytes={len(whole) + 10}-", 416, "range_not_satisfiable")):
        r = httpx.get(url, headers={"Range": value})
        assert r.status_code == status and r.headers["content-type"] == "application/json", (value, r.text)
        assert r.json()["error"]["code"] == code and r.json()["error"]["param"] == "range"
    assert httpx.get(url, headers={"Range": f"bytes={len(whole) + 10}-"}).headers["content-range"] == \
        f"bytes */{len(whole)}"


def test_nosniff_everywhere_and_json_is_never_cached(app_url: str, done: str) -> None:
    paths = ("/healthz", "/readyz", "/v1/videos", f"/v1/videos/{done}", "/v1/waves", "/no/such/route",
             "/openapi.json")
    answers = [httpx.get(f"{app_url}{p}") for p in paths]
    answers += [httpx.put(f"{app_url}/v1/videos"), post(app_url, {"prompt": ""}),
                httpx.get(f"{app_url}/v1/videos/{done}/content")]
    for r in answers:
        assert r.headers["x-content-type-options"] == "nosniff", r.url
        if r.headers["content-type"].startswith("application/json"):
            assert r.headers["cache-control"] == "no-store", r.url


def test_query_string_errors_come_in_the_api_error_shape(app_url: str) -> None:
    for query, param in (("limit=abc", "limit"), ("limit=0", "limit"), ("order=sideways", "order")):
        r = httpx.get(f"{app_url}/v1/videos?{query}")
        assert r.status_code == 422 and r.json()["error"]["param"] == param, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
