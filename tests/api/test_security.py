"""Safe to expose: API keys and ownership, bounded bodies, health that notices a dead rank.

The app with API keys (DP1, under /keyed: the ``keyed`` fixture of tests/api/conftest.py,
shared with test_lora_keys.py's own keys) serves the key checks; the shared open app the
body and health checks.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import ADMIN, KEY_A, KEY_B, UPLOADS_PER_KEY, wait_final


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_no_or_wrong_key_is_401_in_the_openai_shape(keyed: str) -> None:
    for headers in ({}, auth("sk-wrong"), {"Authorization": "Basic abc"}):
        r = httpx.post(f"{keyed}/v1/videos", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{keyed}/v1/videos", headers=headers).status_code == 401
    assert httpx.get(f"{keyed}/healthz").status_code == 200  # health stays open
    assert httpx.get(f"{keyed}/readyz").status_code == 200


def test_a_priority_past_the_keys_floor_is_a_422_naming_it(keyed: str) -> None:
    for key, priority in ((KEY_A, -1), (KEY_B, -6), (KEY_A, 101)):  # key-a's floor: 0; key-b's: -5
        r = httpx.post(f"{keyed}/v1/videos", json={"prompt": "x", "priority": priority}, headers=auth(key))
        assert r.status_code == 422 and r.json()["error"]["param"] == "priority", r.text
    r = httpx.post(f"{keyed}/v1/videos", json={"prompt": "promoted", "priority": -5}, headers=auth(KEY_B))
    assert r.status_code == 202 and r.json()["priority"] == -5, r.text
    done = wait_final(keyed, r.json()["id"], headers=auth(KEY_B))
    assert done["status"] == "completed" and done["priority"] == -5 and done["preemptions"] == 0


def test_jobs_belong_to_the_key_that_made_them(keyed: str) -> None:
    r = httpx.post(f"{keyed}/v1/videos", json={"prompt": "alice's fox", "seed": 1}, headers=auth(KEY_A))
    assert r.status_code == 202, r.text
    vid = r.json()["id"]
    assert "owner" not in r.json()
    assert wait_final(keyed, vid, headers=auth(KEY_A))["status"] == "completed"
    for path in (f"/v1/videos/{vid}", f"/v1/videos/{vid}/content", f"/v1/videos/{vid}/preview"):
        assert httpx.get(f"{keyed}{path}", headers=auth(KEY_B)).status_code == 404
        assert httpx.get(f"{keyed}{path}", headers=auth(KEY_A)).status_code == 200
    # The preview after the end: the last step's, an image with an ETag that a poller gets 304 for.
    img = httpx.get(f"{keyed}/v1/videos/{vid}/preview", headers=auth(KEY_A))
    assert img.headers["content-type"] == "image/webp" and img.content[8:12] == b"WEBP"
    assert img.headers["x-preview-step"] == str(r.json()["num_inference_steps"])
    again = httpx.get(f"{keyed}/v1/videos/{vid}/preview",
                      headers={**auth(KEY_A), "if-none-match": img.headers["etag"]})
    assert again.status_code == 304 and not again.content
    assert vid not in [v["id"] for v in httpx.get(f"{keyed}/v1/videos", headers=auth(KEY_B)).json()["data"]]
    assert vid in [v["id"] for v in httpx.get(f"{keyed}/v1/videos", headers=auth(KEY_A)).json()["data"]]
    bobs = httpx.get(f"{keyed}/v1/waves", headers=auth(KEY_B)).json()  # bob's own jobs only (an
    assert all(vid not in r["ids"] for r in bobs), bobs                 # earlier test made some)
    assert any(vid in r["ids"] for r in httpx.get(f"{keyed}/v1/waves", headers=auth(KEY_A)).json())
    assert httpx.delete(f"{keyed}/v1/videos/{vid}", headers=auth(KEY_B)).status_code == 404
    assert httpx.get(f"{keyed}/v1/videos/{vid}", headers=auth(KEY_A)).status_code == 200  # still there
    assert httpx.delete(f"{keyed}/v1/videos/{vid}", headers=auth(KEY_A)).json()["deleted"]


def test_node_id_is_for_admin_callers_only(keyed: str, app_url: str) -> None:
    """Which Ray node ran a job is the cluster's business (issue 31: every key read it in the
    video object). A key's answers say null; an open service with no key of either kind has
    no one to hide it from (every caller is its admin: keys.py), so it still says it."""
    import ray

    body = {"prompt": "where did it run", "seed": 2, "num_inference_steps": 2}
    r = httpx.post(f"{keyed}/v1/videos", json=body, headers=auth(KEY_A))
    assert r.status_code == 202, r.text
    vid = r.json()["id"]
    final = wait_final(keyed, vid, headers=auth(KEY_A))
    page = httpx.get(f"{keyed}/v1/videos", headers=auth(KEY_A)).json()["data"]
    listed = [v for v in page if v["id"] == vid]
    for v in (r.json(), final, *listed):
        assert v["node_id"] is None and v["dp_group"], v
    assert listed and final["status"] == "completed"
    httpx.delete(f"{keyed}/v1/videos/{vid}", headers=auth(KEY_A))
    node = ray.get_runtime_context().get_node_id()
    r = httpx.post(f"{app_url}/v1/videos", json=body)
    assert r.status_code == 202 and r.json()["node_id"] == node, r.text
    assert wait_final(app_url, r.json()["id"])["node_id"] == node
    httpx.delete(f"{app_url}/v1/videos/{r.json()['id']}")


def raw_post(url: str, headers: str, body: bytes = b"") -> tuple[int, float]:
    """Send a request by hand (a declared length the client never sends); status and time."""
    host, port = url.split("//")[1].split(":")
    t0 = time.monotonic()
    with socket.create_connection((host, int(port.split("/")[0])), timeout=30) as s:
        s.sendall(f"POST /v1/videos HTTP/1.1\r\nHost: {host}\r\n{headers}\r\n".encode() + body)
        status = int(s.recv(4096).split(b" ", 2)[1])
    return status, time.monotonic() - t0


def test_bodies_over_the_cap_are_413_before_they_are_read(app_url: str) -> None:
    status, seconds = raw_post(app_url, "Content-Type: application/json\r\nContent-Length: 100000000\r\n")
    assert status == 413 and seconds < 10  # answered without waiting for 100 MB that never come

    def chunks() -> Iterator[bytes]:  # no declared length: cut off at the cap while streaming
        yield b'{"prompt": "'
        for _ in range(1000):
            yield b"x" * 100_000

    r = httpx.post(f"{app_url}/v1/videos", content=chunks(), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_unsupported_media_type_is_415(app_url: str) -> None:
    r = httpx.post(f"{app_url}/v1/videos", content=b"prompt: x", headers={"content-type": "text/yaml"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"


def test_deep_json_is_422_not_500(app_url: str) -> None:
    deep = b'{"prompt": ' + b"[" * 20000 + b"]" * 20000 + b"}"
    r = httpx.post(f"{app_url}/v1/videos", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text


@pytest.mark.e2e  # waits out a queue limit while real starts fail
def test_health_check_reports_an_engine_that_cannot_start(ray_cluster: dict, demo_model: str,
                                                          tmp_path: Path) -> None:
    """A truncated checkpoint: every rank fails to load, the starts are retried; a job accepted
    meanwhile waits its queue limit and fails naming the file; once the retries keep failing
    new jobs get 503 naming it; the replica's check_health (what Serve calls) says why."""
    import shutil

    from service.api.service import ServiceConfig, VideoService
    from service.router.health import Unavailable

    model = tmp_path / "broken"
    shutil.copytree(demo_model, model)
    weights = next((model / "transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    svc = VideoService(ServiceConfig(model=str(model), data_parallel_size=1, cpus_per_rank=0.25,
                                     encoders_per_rank=0,
                                     results_url=str(tmp_path / "r"), unhealthy_after_s=1.0,
                                     max_queue_wait_s=60.0))
    try:
        rec = svc.create({"prompt": "never"})  # the first start is still running: it waits
        end = time.monotonic() + 120
        while not (svc.get(rec.id) and svc.get(rec.id).final):
            assert time.monotonic() < end, svc.readiness()
            time.sleep(0.2)
        err = svc.get(rec.id).error["message"]
        assert "in the queue" in err and weights.name in err, err
        while svc.readiness()["state"] != "down":
            assert time.monotonic() < end, svc.readiness()
            time.sleep(0.2)
        with pytest.raises(Unavailable) as refused:
            svc.create({"prompt": "refused"})
        assert weights.name in str(refused.value) and refused.value.retry_after_s >= 1
        while svc.health_problem() is None:
            assert time.monotonic() < end, svc.readiness()
            time.sleep(0.2)
        assert weights.name in svc.health_problem()
        assert not svc.readiness()["ready"]
    finally:
        svc.close()


def test_readyz_without_a_key_says_ready_or_not_and_the_detail_needs_one(keyed: str) -> None:
    anonymous = httpx.get(f"{keyed}/readyz")
    assert anonymous.status_code == 200 and set(anonymous.json()) == {"ready", "instance"}
    assert httpx.head(f"{keyed}/readyz").status_code == 200
    tenant = httpx.get(f"{keyed}/readyz", headers=auth(KEY_A)).json()
    assert tenant["state"] == "ready" and tenant["yours"]["max_queued"] == 1
    assert not {"model_dir", "results_url", "node_id", "workers", "queue_depth", "in_flight"} & set(tenant)
    admin = httpx.get(f"{keyed}/readyz", headers=auth(ADMIN)).json()
    assert {"model_dir", "results_url", "node_id", "workers", "queue_depth", "in_flight"} <= set(admin)
    assert httpx.get(f"{keyed}/v1/videos", headers=auth(ADMIN)).status_code == 401  # owns no jobs
    assert httpx.get(f"{keyed}/v1/waves", headers=auth(ADMIN)).status_code == 200


def test_query_string_errors_come_after_the_key_check(keyed: str) -> None:
    r = httpx.get(f"{keyed}/v1/videos?limit=abc")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    r = httpx.get(f"{keyed}/v1/videos?limit=abc", headers=auth(KEY_A))
    assert r.status_code == 422 and r.json()["error"]["param"] == "limit", r.text


def test_a_key_over_its_own_queue_quota_gets_429_and_another_key_is_accepted(keyed: str) -> None:
    long = {"prompt": "holds the rank", "num_inference_steps": 60}
    running = httpx.post(f"{keyed}/v1/videos", json=long, headers=auth(KEY_A)).json()["id"]
    end = time.monotonic() + 120
    while httpx.get(f"{keyed}/v1/videos/{running}", headers=auth(KEY_A)).json()["status"] == "queued":
        assert time.monotonic() < end
        time.sleep(0.05)
    ids = [running, httpx.post(f"{keyed}/v1/videos", json=long, headers=auth(KEY_A)).json()["id"]]
    over = httpx.post(f"{keyed}/v1/videos", json=long, headers=auth(KEY_A))
    assert over.status_code == 429 and over.json()["error"]["code"] == "quota_exceeded", over.text
    assert int(over.headers["retry-after"]) >= 1 and "max_queued 1" in over.json()["error"]["message"]
    other = httpx.post(f"{keyed}/v1/videos", json={"prompt": "bob's"}, headers=auth(KEY_B))
    assert other.status_code == 202, other.text
    for vid, key in ((ids[1], KEY_A), (other.json()["id"], KEY_B), (running, KEY_A)):
        httpx.delete(f"{keyed}/v1/videos/{vid}", headers=auth(key))
    assert wait_final(keyed, running, headers=auth(KEY_A))["status"] == "cancelled"


def test_slow_bodies_are_cut_off_not_waited_for(keyed: str) -> None:
    """20 clients of one key declare a 1,000-byte body and send a byte every 0.5 s: each is
    answered long before its body could be complete (it would take 500 s)."""
    from concurrent.futures import ThreadPoolExecutor

    host, port = keyed.split("//")[1].split("/")[0].split(":")

    def slow_client(i: int) -> tuple[int, int]:
        with socket.create_connection((host, int(port)), timeout=60) as s:
            s.sendall(f"POST /keyed/v1/videos HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY_A}\r\n"
                      "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n".encode())
            s.settimeout(0.5)
            sent, answer = 0, b""
            while sent < 200 and not answer:
                s.sendall(b" ")
                sent += 1
                try:
                    answer = s.recv(4096)
                except TimeoutError:
                    continue
            return (int(answer.split(b" ", 2)[1]) if answer else -1), sent

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(slow_client, range(20)))
    # Each is cut off (408), or refused at once (429: its key already sends its share).
    assert all(status in (408, 429) for status, _ in results), results
    assert sum(status == 429 for status, _ in results) >= 20 - UPLOADS_PER_KEY, results
    assert all(sent < 1000 for _, sent in results)
    listed = httpx.get(f"{keyed}/v1/videos", headers=auth(KEY_A)).json()["data"]
    assert not [v for v in listed if v["prompt"] == " "]


def open_upload(url: str, key: str, first: bytes = b"{") -> socket.socket:
    """A POST whose body starts (``first``) and then stalls; the caller closes it."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    path = url.split(port, 1)[1]
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(f"POST {path}/v1/videos HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
              "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n".encode() + first)
    return s


def answer_of(s: socket.socket) -> tuple[int, bytes]:
    """The status and the whole answer (it ends with the connection, or its body's length)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1]), data.lower()


def _length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    for line in head.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 1


def test_one_key_holding_its_uploads_gets_429_and_health_and_other_keys_still_answer(keyed: str) -> None:
    """A key's slow uploads take a few of the replica's request slots, never all: its next
    one is refused at once, while /healthz, /readyz and another key are answered."""
    held = [open_upload(keyed, KEY_A) for _ in range(UPLOADS_PER_KEY)]
    try:
        end = time.monotonic() + 30
        while httpx.get(f"{keyed}/readyz", headers=auth(ADMIN)).json().get("uploads") != UPLOADS_PER_KEY:
            assert time.monotonic() < end, "the held uploads never reached the replica"
            time.sleep(0.05)
        extra = open_upload(keyed, KEY_A)
        try:
            status, data = answer_of(extra)
        finally:
            extra.close()
        assert status == 429 and b"too_many_uploads" in data and b"retry-after: 1" in data, data
        assert httpx.get(f"{keyed}/healthz").status_code == 200
        assert httpx.get(f"{keyed}/readyz").status_code == 200
        assert httpx.get(f"{keyed}/v1/videos", headers=auth(KEY_B)).status_code == 200
        r = httpx.post(f"{keyed}/v1/videos", json={"prompt": "bob", "num_inference_steps": 1},
                       headers=auth(KEY_B))
        assert r.status_code == 202, r.text  # another key's upload is no business of key A's cap
        assert httpx.get(f"{keyed}/readyz", headers=auth(ADMIN)).json()["uploads"] == UPLOADS_PER_KEY
        wait_final(keyed, r.json()["id"], headers=auth(KEY_B))
        httpx.delete(f"{keyed}/v1/videos/{r.json()['id']}", headers=auth(KEY_B))
    finally:
        for s in held:
            s.close()
        # The next tests upload as key A too: they must find its slots free, not still held
        # by sockets the replica has not yet seen close (a 429 where they expect their answer).
        end = time.monotonic() + 30
        while time.monotonic() < end and httpx.get(f"{keyed}/readyz", headers=auth(ADMIN)).json()["uploads"]:
            time.sleep(0.05)


def test_a_body_that_never_starts_is_cut_off_at_the_first_byte_timeout(keyed: str) -> None:
    s = open_upload(keyed, KEY_A, first=b"")
    try:
        status, data = answer_of(s)
    finally:
        s.close()
    assert status == 408 and b"did not start within 1 s" in data, data
