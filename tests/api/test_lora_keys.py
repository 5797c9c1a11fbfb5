"""Adapters with API keys, over real HTTP and real Ray: names per key, a per-key cap, the
list in pages, no server path in any answer, and a FIFO's registrations that hold up nothing.

On the app with API keys (DP1, under /keyed: the ``keyed`` fixture of tests/api/conftest.py,
shared with test_security.py's own keys): two keys of this module's, `--lora-dir` and one
adapter of the server's, beside the shared open app.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import LORA_CAP as CAP
from tests.api.conftest import LORA_KEY_A as KEY_A
from tests.api.conftest import LORA_KEY_B as KEY_B
from tests.api.conftest import wait_final
from tests.api.test_adapter_io import release

JOB = {"prompt": "a red fox", "size": "32x32", "num_frames": 5, "num_inference_steps": 2, "seed": 4}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def lora_dir(keyed_lora_dir: Path) -> Path:
    return keyed_lora_dir


@pytest.fixture
def app(keyed: str) -> str:
    return keyed


def register(url: str, key: str, name: str, source: Path | str) -> httpx.Response:
    return httpx.post(f"{url}/v1/loras", json={"name": name, "source": str(source)}, headers=auth(key),
                      timeout=60)


def names(url: str, key: str) -> list[str]:
    r = httpx.get(f"{url}/v1/loras?limit=100", headers=auth(key))
    assert r.status_code == 200, r.text
    return [e["name"] for e in r.json()["data"]]


def run(url: str, key: str, loras: list[dict]) -> bytes:
    r = httpx.post(f"{url}/v1/videos", json={**JOB, "loras": loras}, headers=auth(key), timeout=30)
    assert r.status_code == 202, r.text
    vid = r.json()["id"]
    assert wait_final(url, vid, 180, headers=auth(key))["status"] == "completed"
    content = httpx.get(f"{url}/v1/videos/{vid}/content", headers=auth(key), timeout=30)
    httpx.delete(f"{url}/v1/videos/{vid}", headers=auth(key))
    return content.content


def test_two_keys_each_register_style_and_each_job_runs_its_own(app: str, lora_dir: Path) -> None:
    """Before: the second key's `style` was a 409 telling it that another key had one. Now each
    key has its own, lists only its own (and the server's), and its job runs with its own
    file on the rank: Alice's `style` with Bob's file under another name gives Bob's bytes."""
    assert register(app, KEY_A, "style", lora_dir / "alice.safetensors").status_code == 201
    r = register(app, KEY_B, "style", lora_dir / "bob.safetensors")
    assert r.status_code == 201, r.text
    assert r.json()["sha256"] == hashlib.sha256((lora_dir / "bob.safetensors").read_bytes()).hexdigest()
    assert register(app, KEY_A, "bobs", lora_dir / "bob.safetensors").status_code == 201
    try:
        assert names(app, KEY_A) == ["server", "style", "bobs"] and names(app, KEY_B) == ["server", "style"]
        taken = register(app, KEY_B, "server", lora_dir / "bob.safetensors")
        assert taken.status_code == 409 and taken.json()["error"]["param"] == "name", taken.text
        unknown = httpx.post(f"{app}/v1/videos", json={**JOB, "loras": [{"name": "bobs"}]},
                             headers=auth(KEY_B))
        assert unknown.status_code == 422 and unknown.json()["error"]["param"] == "loras[0].name"
        a, b = run(app, KEY_A, [{"name": "style"}]), run(app, KEY_B, [{"name": "style"}])
        assert a != b
        assert run(app, KEY_A, [{"name": "bobs"}]) == b  # the rank took each key's own file
        assert httpx.delete(f"{app}/v1/loras/style", headers=auth(KEY_A)).status_code == 200
        assert names(app, KEY_B) == ["server", "style"]  # Bob's own is untouched
        assert httpx.delete(f"{app}/v1/loras/server", headers=auth(KEY_B)).status_code == 404
    finally:
        for key, name in ((KEY_A, "style"), (KEY_A, "bobs"), (KEY_B, "style")):
            httpx.delete(f"{app}/v1/loras/{name}", headers=auth(key))


def test_a_key_over_its_adapter_cap_gets_409_naming_name(app: str, lora_dir: Path) -> None:
    made = [f"c{i}" for i in range(CAP)]
    try:
        for name in made:
            assert register(app, KEY_A, name, lora_dir / "alice.safetensors").status_code == 201
        over = register(app, KEY_A, "one-more", lora_dir / "alice.safetensors")
        err = over.json()["error"]
        assert over.status_code == 409, over.text
        assert (err["param"], err["code"]) == ("name", "too_many_loras"), err
        assert f"the most it may have ({CAP})" in err["message"]
        # another key has a cap of its own
        assert register(app, KEY_B, "one-more", lora_dir / "bob.safetensors").status_code == 201
        httpx.delete(f"{app}/v1/loras/one-more", headers=auth(KEY_B))
        assert httpx.delete(f"{app}/v1/loras/c0", headers=auth(KEY_A)).status_code == 200
        made.remove("c0")
        assert register(app, KEY_A, "one-more", lora_dir / "alice.safetensors").status_code == 201
        made.append("one-more")
    finally:
        for name in made:
            httpx.delete(f"{app}/v1/loras/{name}", headers=auth(KEY_A))


def test_the_list_pages_like_the_videos_list(app: str, lora_dir: Path) -> None:
    made = ["p1", "p2"]
    for name in made:
        assert register(app, KEY_B, name, lora_dir / "bob.safetensors").status_code == 201
    try:
        seen, after = [], None
        while True:
            q = f"?limit=1&after={after}" if after else "?limit=1"
            page = httpx.get(f"{app}/v1/loras{q}", headers=auth(KEY_B)).json()
            assert len(page["data"]) == 1 and page["first_id"] == page["last_id"] == page["data"][0]["id"]
            seen.append(page["last_id"])
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert seen == ["server", "p1", "p2"]
        desc = httpx.get(f"{app}/v1/loras?order=desc&limit=2", headers=auth(KEY_B)).json()
        assert [e["id"] for e in desc["data"]] == ["p2", "p1"] and desc["has_more"]
        empty = httpx.get(f"{app}/v1/loras?after=nope", headers=auth(KEY_B)).json()
        assert empty["data"] == [] and not empty["has_more"]
        bad = httpx.get(f"{app}/v1/loras?limit=0", headers=auth(KEY_B))
        assert bad.status_code == 422 and bad.json()["error"]["param"] == "limit"
        assert httpx.get(f"{app}/v1/loras?limit=0").status_code == 401  # the key first
    finally:
        for name in made:
            httpx.delete(f"{app}/v1/loras/{name}", headers=auth(KEY_B))


def test_no_answer_about_adapters_carries_a_server_path(app: str, lora_dir: Path, tmp_path: Path) -> None:
    """Before: a bad file's 422 began with its path, a source outside the folders got the
    folders' list, and a FIFO's 422 named the path."""
    import os

    os.mkfifo(lora_dir / "pipe.safetensors")
    outside = tmp_path / "x.safetensors"
    outside.write_bytes(b"x")
    answers = [register(app, KEY_A, "junk", lora_dir / "junk.safetensors"),
               register(app, KEY_A, "pipe", lora_dir / "pipe.safetensors"),
               register(app, KEY_A, "out", outside),
               register(app, KEY_A, "ok", lora_dir / "alice.safetensors")]
    try:
        assert [r.status_code for r in answers] == [422, 422, 403, 201], [r.text for r in answers]
        answers += [httpx.get(f"{app}/v1/loras", headers=auth(KEY_A)),
                    httpx.delete(f"{app}/v1/loras/ok", headers=auth(KEY_A)),
                    httpx.delete(f"{app}/v1/loras/ok", headers=auth(KEY_A))]
        for r in answers:
            assert str(lora_dir) not in r.text and str(tmp_path) not in r.text, r.text
            assert "/tmp" not in r.text, r.text
    finally:
        httpx.delete(f"{app}/v1/loras/ok", headers=auth(KEY_A))


def test_fifo_registrations_are_refused_and_do_not_stop_job_submission(app: str, lora_dir: Path) -> None:
    """Twelve registrations of a FIFO under --lora-dir at once, six per key (each used to block a thread of
    the pool POST /v1/videos shares, for good): each is a 422 naming ``source`` (or a 503 when
    the registration threads are all busy), and a job posted meanwhile is accepted and completes.
    (The hung read itself: tests/api/test_adapter_io.py.)"""
    fifo = lora_dir / "hung.safetensors"
    os.mkfifo(fifo)
    try:
        with ThreadPoolExecutor(12) as pool:
            regs = [pool.submit(register, app, (KEY_A, KEY_B)[i % 2], f"p{i}", fifo) for i in range(12)]
            job = httpx.post(f"{app}/v1/videos", json=JOB, headers=auth(KEY_B), timeout=15)
            answers = [f.result() for f in regs]
        assert job.status_code == 202, job.text
        for r in answers:  # refused unopened, or (every reading thread busy) at once with Retry-After
            assert r.status_code in (422, 503) and r.json()["error"]["param"] == "source", r.text
            assert r.status_code == 503 and "retry-after" in r.headers or \
                "a FIFO: adapters must be regular files" in r.json()["error"]["message"], r.text
        assert any(r.status_code == 422 for r in answers)
        assert names(app, KEY_A) == names(app, KEY_B) == ["server"]
        assert wait_final(app, job.json()["id"], 180, headers=auth(KEY_B))["status"] == "completed"
    finally:
        release(fifo)
        fifo.unlink()
