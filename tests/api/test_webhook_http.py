"""Webhook delivery a receiver cannot bend (service/api/webhook_http.py, the per-target lanes
of webhooks.py): real receivers on 127.0.0.1 (http.server, and a raw socket that trickles a
header line at a time), the operator's allow flag on where the test needs loopback.

- one tenant's receiver that trickles its answer, or answers 500, holds and fills only its
  own lane: another tenant's events arrive; the trickler is cut off at the whole-request
  deadline; a target failing again and again rests behind its breaker;
- a 3xx is an answer, never followed;
- loopback, private, link-local and mapped addresses are refused at connect time unless the
  operator allows them.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from service.api.records import JobRecord, JobStatus
from service.api.webhook_http import RefusedAddress, checked_address
from service.api.webhooks import Webhooks
from tests.api.test_webhooks import SECRET, Receiver, until


def event(owner: str, i: int = 0) -> JobRecord:
    return JobRecord(id=f"video_{owner}_{i}", created_at=1, owner=owner, status=JobStatus.COMPLETED,
                     completed_at=2)


class Trickler:
    """Accepts, reads the request, then sends one header line every ``every_s``, forever (a
    read timeout per line never fires)."""

    def __init__(self, every_s: float = 0.3) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"
        self.every_s = every_s
        self.stop = threading.Event()
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        try:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            while not self.stop.wait(self.every_s):
                conn.sendall(b"x-slow: 1\r\n")
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.fixture
def trickler() -> Iterator[Trickler]:
    t = Trickler()
    yield t
    t.close()


def test_a_trickling_receiver_holds_only_its_own_lane_and_is_cut_at_the_deadline(trickler: Trickler) -> None:
    fast = Receiver()
    keys = {"slow": {"url": trickler.url, "secret": SECRET}, "fast": {"url": fast.url, "secret": SECRET}}
    hooks = Webhooks.from_config({"keys": keys, "allow_private": True}, timeout_s=2.0, backoff_s=60.0)
    assert hooks is not None
    try:
        for i in range(3):  # more than the old shared senders
            hooks.on_final(event("slow", i))
        until(lambda: trickler.connections >= 1)
        hooks.on_final(event("fast"))
        until(lambda: len(fast.got) == 1)  # not behind the slow tenant's events
        until(lambda: hooks.failures.get("timeout", 0) >= 1)  # the whole request's deadline
    finally:
        hooks.close()
        fast.close()


def test_a_failing_receiver_fills_only_its_own_queue_and_rests_behind_its_breaker() -> None:
    failing, fine = Receiver(answers=[500] * 100), Receiver()
    keys = {"bad": {"url": failing.url, "secret": SECRET}, "good": {"url": fine.url, "secret": SECRET}}
    hooks = Webhooks.from_config({"keys": keys, "allow_private": True}, queue_size=3, backoff_s=0.01,
                                 breaker_failures=3, breaker_s=600.0)
    assert hooks is not None
    try:
        for i in range(10):
            hooks.on_final(event("bad", i))
        for i in range(3):
            hooks.on_final(event("good", i))
        until(lambda: len(fine.got) == 3)  # its queue had room, whatever the other's retries
        until(lambda: hooks.failures.get("breaker_open") == 1)
        assert len(failing.got) == 3  # and no attempt while its breaker is open
        assert hooks.failures["queue_full"] >= 6
    finally:
        hooks.close()
        failing.close()
        fine.close()


class Redirector:
    """Answers every POST 302 to ``location``; records any request it gets (an internal
    address would)."""

    def __init__(self, location: str = "") -> None:
        self.got: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                outer.got.append(self.command)
                n = int(self.headers.get("content-length") or 0)
                self.rfile.read(n)
                self.send_response(302 if location else 200)
                if location:
                    self.send_header("location", location)
                self.send_header("content-length", "0")
                self.end_headers()

            do_GET = do_POST = _any  # noqa: N815 - http.server's names

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_redirect_is_an_answer_never_followed() -> None:
    internal = Redirector()
    hop = Redirector(location=internal.url + "latest/meta-data/")
    hooks = Webhooks.from_config({"url": hop.url, "secret": SECRET, "allow_private": True}, backoff_s=0.01)
    assert hooks is not None
    try:
        hooks.on_final(event("k"))
        until(lambda: hooks.failures.get("given_up") == 1)
        assert hooks.failures["redirect"] == 1 and hooks.sent == 0  # one attempt: a redirect is final
        assert hop.got == ["POST"] and internal.got == []
    finally:
        hooks.close()
        hop.close()
        internal.close()


def test_private_addresses_are_refused_at_connect_unless_allowed() -> None:
    for host in ("127.0.0.1", "localhost", "10.1.2.3", "192.168.0.1", "169.254.169.254", "100.64.0.1",
                 "::1", "::ffff:127.0.0.1", "fe80::1", "0.0.0.0"):
        with pytest.raises(RefusedAddress):
            checked_address(host, 80, allow_private=False)
    assert checked_address("127.0.0.1", 80, allow_private=True) == ("127.0.0.1", 80)
    assert checked_address("93.184.216.34", 443, allow_private=False) == ("93.184.216.34", 443)
    r = Receiver()
    hooks = Webhooks.from_config({"url": r.url.replace("127.0.0.1", "localhost"), "secret": SECRET},
                                 backoff_s=0.01)
    assert hooks is not None
    try:
        hooks.on_final(event("k"))
        until(lambda: hooks.failures.get("given_up") == 1)
        assert hooks.failures["refused_address"] == 1 and r.got == []
    finally:
        hooks.close()
        r.close()
