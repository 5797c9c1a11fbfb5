"""Signed webhooks: a loopback receiver (http.server in a thread) gets the events of jobs that
end through VideoService (fake executor, in-process job store), verifies each signature with
the Standard Webhooks algorithm written out here, and sees retries keep their webhook-id."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from service.api.jobs import JobStore
from service.api.keys import KeyFileError, parse_key_lines
from service.api.records import JobRecord, JobStatus
from service.api.service import ServiceConfig, VideoService
from service.api.webhooks import WebhookConfigError, Webhooks, parse_secret
from tests.fakes import FakeExecutor

BODY = {"prompt": "a red fox", "seed": 1, "num_inference_steps": 2}
SECRET = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def verify(secret: str, headers: dict[str, str], body: bytes) -> bool:
    """Standard Webhooks, written out: HMAC-SHA256 keyed with the base64 part of the secret,
    over "{webhook-id}.{webhook-timestamp}.{body}", base64, after "v1," (one of several
    space-separated signatures)."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    return any(hmac.compare_digest(sig.removeprefix("v1,"), expected)
               for sig in headers["webhook-signature"].split() if sig.startswith("v1,"))


class Receiver:
    """A loopback HTTP server recording what it is sent; ``answers`` are its status codes in
    order (then 200); ``hang`` makes it never answer."""

    def __init__(self, answers: list[int] | None = None, hang: bool = False) -> None:
        self.got: list[tuple[dict[str, str], bytes]] = []
        self.answers = list(answers or [])
        self.release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["content-length"]))
                outer.got.append(({k.lower(): v for k, v in self.headers.items()}, body))
                if hang:
                    outer.release.wait(30)
                    return
                self.send_response(outer.answers.pop(0) if outer.answers else 200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(b) for _, b in self.got]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def until(cond: Any, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.01)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def service_with(demo_model: str, tmp_path: Path, webhooks: dict[str, Any], **cfg: Any,
                 ) -> tuple[VideoService, FakeExecutor, JobStore]:
    ex = FakeExecutor((1,))
    store = JobStore(str(tmp_path), {}, 3600.0, 100, 30.0, webhooks={**webhooks, "allow_private": True})
    svc = VideoService(ServiceConfig(model=demo_model, results_url=str(tmp_path), **cfg), executor=ex,
                       store=store, node_id="node-1")
    return svc, ex, store


def test_completed_and_failed_jobs_post_signed_events(demo_model: str, tmp_path: Path,
                                                      receiver: Receiver) -> None:
    svc, ex, store = service_with(demo_model, tmp_path, {"url": receiver.url, "secret": SECRET})
    try:
        ok, bad = svc.create(dict(BODY)), svc.create(dict(BODY))
        ex.wait_assigned(ok.id)
        ex.run(ok.id)
        ex.wait_assigned(bad.id)
        ex.run(bad.id, error="RuntimeError: boom")
        until(lambda: len(receiver.got) == 2)
    finally:
        svc.close()
        store.close()
    by_video = {e["data"]["id"]: e for e in receiver.events()}
    assert by_video[ok.id]["type"] == "video.completed" and by_video[bad.id]["type"] == "video.failed"
    for headers, body in receiver.got:
        event = json.loads(body)
        assert verify(SECRET, headers, body)
        assert headers["webhook-id"] == event["id"] and event["id"].startswith("evt_")
        assert event["object"] == "event" and isinstance(event["created_at"], int)
        assert abs(int(headers["webhook-timestamp"]) - time.time()) < 300
        assert not verify("whsec_" + base64.b64encode(b"x" * 32).decode(), headers, body)


def test_a_key_gets_only_its_own_events_and_the_instance_gets_all(demo_model: str, tmp_path: Path) -> None:
    mine, theirs, ops = Receiver(), Receiver(), Receiver()
    keys = {"k-mine": {"url": mine.url, "secret": SECRET}, "k-theirs": {"url": theirs.url, "secret": SECRET}}
    hooks = Webhooks.from_config({"url": ops.url, "secret": SECRET, "keys": keys, "allow_private": True})
    assert hooks is not None
    try:
        for owner in ("k-mine", "k-mine", "k-other"):
            hooks.on_final(JobRecord(id=f"video_{owner}_{secrets.token_hex(4)}", created_at=1, owner=owner,
                                     status=JobStatus.CANCELLED, completed_at=2))
        until(lambda: len(ops.got) == 3 and len(mine.got) == 2)
        hooks.close()
        assert theirs.got == [] and {e["type"] for e in mine.events()} == {"video.cancelled"}
        assert all("k-mine" in e["data"]["id"] for e in mine.events())
    finally:
        for r in (mine, theirs, ops):
            r.close()


def test_retries_after_500_keep_the_webhook_id() -> None:
    r = Receiver(answers=[500, 500])
    hooks = Webhooks.from_config({"url": r.url, "secret": SECRET, "allow_private": True}, backoff_s=0.05)
    assert hooks is not None
    try:
        hooks.on_final(JobRecord(id="video_x", created_at=1, status=JobStatus.COMPLETED, completed_at=2))
        until(lambda: hooks.sent == 1)
        ids = [h["webhook-id"] for h, _ in r.got]
        assert len(ids) == 3 and len(set(ids)) == 1
        assert all(verify(SECRET, h, b) for h, b in r.got) and hooks.failures == {"http_5xx": 2}
    finally:
        hooks.close()
        r.close()


def test_a_receiver_that_never_answers_does_not_slow_job_creation(demo_model: str, tmp_path: Path) -> None:
    """The sender waits on a receiver that never answers (its timeout is far off); meanwhile
    jobs are created, run and end: none of it waits on the delivery, whose events queue."""
    r = Receiver(hang=True)
    svc, ex, store = service_with(demo_model, tmp_path, {"url": r.url, "secret": SECRET})
    hooks = store.webhooks
    assert hooks is not None
    try:
        first = svc.create(dict(BODY))
        ex.wait_assigned(first.id)
        ex.run(first.id)
        until(lambda: len(r.got) == 1)  # a sender is now stuck on the silent receiver
        made = []
        for _ in range(3):
            made.append(svc.create(dict(BODY)))
            ex.wait_assigned(made[-1].id)
            ex.run(made[-1].id)
        until(lambda: all(svc.store.get(m.id).status is JobStatus.COMPLETED for m in made))
        # All of that happened while the first delivery was still waiting for an answer.
        assert hooks.sent == 0 and hooks.failures == {} and r.got[0][1].count(first.id.encode()) == 1
    finally:
        r.release.set()
        svc.close()
        store.close()
        r.close()


def test_a_full_queue_drops_and_counts_without_blocking() -> None:
    r = Receiver(hang=True)
    hooks = Webhooks.from_config({"url": r.url, "secret": SECRET, "allow_private": True}, queue_size=2)
    assert hooks is not None
    try:
        for i in range(6):  # one in flight (stuck), two queued, the rest dropped
            hooks.on_final(JobRecord(id=f"video_{i}", created_at=1, status=JobStatus.FAILED, completed_at=2))
            if i == 0:
                until(lambda: len(r.got) == 1)
        assert hooks.pending == 2 and hooks.failures == {"queue_full": 3}
    finally:
        r.release.set()
        hooks.close()
        r.close()


def test_secrets_urls_and_key_file_lines_are_checked() -> None:
    assert len(parse_secret(SECRET)) == 32
    for bad in ("not-whsec", "whsec_%%%", "whsec_" + base64.b64encode(b"short").decode()):
        with pytest.raises(WebhookConfigError):
            parse_secret(bad)
    entry, = parse_key_lines([f"sk-1 max_queued=2 webhook_url=http://127.0.0.1:9/h webhook_secret={SECRET}"])
    assert entry.quota == {"max_queued": 2}
    assert entry.webhook == {"url": "http://127.0.0.1:9/h", "secret": SECRET}
    with pytest.raises(KeyFileError, match="keys:1"):
        parse_key_lines(["sk-1 webhook_url=ftp://x webhook_secret=" + SECRET], "keys")
    with pytest.raises(KeyFileError, match="both a URL and a secret"):
        parse_key_lines(["sk-1 webhook_url=http://127.0.0.1:9/h"])
    with pytest.raises(ValueError, match="go together"):
        ServiceConfig(webhook_url="http://127.0.0.1:9/h")


def test_serve_flags_give_the_store_its_targets(tmp_path: Path) -> None:
    """--webhook-url/--webhook-secret-file and the key file's webhook_url=/webhook_secret= become
    the ServiceConfig fields, and those the job store's targets (by owner id)."""
    import argparse

    from service.api.keys import key_hash, owner_id
    from service.api.serve_flags import add_arguments, webhook_settings

    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    keys = tmp_path / "keys"
    keys.write_text(f"sk-a webhook_url=http://127.0.0.1:9/a webhook_secret={SECRET}\nsk-b max_queued=2\n")
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--webhook-url", "http://127.0.0.1:9/ops", "--webhook-secret-file", str(secret),
                         "--api-key-file", str(keys)])
    cfg = ServiceConfig(**webhook_settings(args))
    assert cfg.webhook_targets() == {"url": "http://127.0.0.1:9/ops", "secret": SECRET,
                                     "keys": {owner_id(key_hash("sk-a")): {"url": "http://127.0.0.1:9/a",
                                                                           "secret": SECRET}}}
    secret.write_text("not a secret")
    with pytest.raises(WebhookConfigError, match="--webhook-secret-file"):
        webhook_settings(args)
    with pytest.raises(WebhookConfigError, match="go together"):
        webhook_settings(p.parse_args(["--webhook-url", "http://127.0.0.1:9/ops"]))


def test_secret_files_readable_by_others_are_warned_of_and_the_private_flag_reaches_the_store(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import argparse

    from service.api.serve_flags import add_arguments, webhook_settings

    secret, keys = tmp_path / "secret", tmp_path / "keys"
    secret.write_text(SECRET + "\n")
    keys.write_text(f"sk-a webhook_url=http://127.0.0.1:9/a webhook_secret={SECRET}\n")
    p = argparse.ArgumentParser()
    add_arguments(p)
    argv = ["--webhook-url", "http://127.0.0.1:9/ops", "--webhook-secret-file", str(secret),
            "--api-key-file", str(keys)]
    for path in (secret, keys):
        path.chmod(0o600)
    with caplog.at_level("WARNING", logger="dloserve.webhooks"):
        cfg = ServiceConfig(**webhook_settings(p.parse_args(argv)))
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "readable" not in warned and "allow_private" not in cfg.webhook_targets()
    assert "--webhook-url http://127.0.0.1:9/ops is a private address" in warned  # refused unless allowed
    assert "a key's webhook_url http://127.0.0.1:9/a is a private address" in warned
    caplog.clear()
    secret.chmod(0o644)
    keys.chmod(0o640)
    with caplog.at_level("WARNING", logger="dloserve.webhooks"):
        cfg = ServiceConfig(**webhook_settings(p.parse_args([*argv, "--webhook-allow-private"])))
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "private address" not in warned
    assert f"--webhook-secret-file {secret} is readable by other users (mode 644)" in warned
    assert f"--api-key-file (its webhook_secret= values) {keys} is readable" in warned
    assert cfg.webhook_targets()["allow_private"] is True
