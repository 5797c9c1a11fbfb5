"""Signed webhooks when a job ends: ``video.completed``, ``video.failed``, ``video.cancelled``.

Events have the shape of OpenAI's video webhook events and are signed per the Standard
Webhooks spec: headers ``webhook-id`` (the event id, the same on every retry),
``webhook-timestamp`` (seconds, of this attempt) and ``webhook-signature``
(``v1,<base64 HMAC-SHA256(secret, "{id}.{timestamp}.{body}")>``), the secret given as
``whsec_<base64>``. Targets come from the operator only: the instance's (``--webhook-url``,
every job's events) and each API key's own (the key file: that key's jobs only).

Where: the job store calls ``Webhooks.on_final`` from ``JobTable.finish``, the one place a
record becomes final, so every job that ends (on any replica, or failed by the store's
reaper when its replica is lost) is announced once by the store's process. Delivery is at
least once: a bounded queue (a full queue drops the event and counts it, it never blocks
the caller), sender threads that retry errors, non-2xx answers and timeouts with
exponential backoff, and the failures counted in ``dloserve_webhook_failures_total``. The
queue lives in the store's memory: deliveries pending when its process dies are lost.
"""

from __future__ import annotations

import base64
import hashlib
import heapq
import hmac
import itertools
import json
import logging
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any

from service.api.records import JobRecord, JobStatus

log = logging.getLogger("dloserve.webhooks")
EVENT_TYPES = {JobStatus.COMPLETED: "video.completed", JobStatus.FAILED: "video.failed",
               JobStatus.CANCELLED: "video.cancelled"}
SECRET_PREFIX = "whsec_"


class WebhookConfigError(ValueError):
    """A webhook URL or secret the service cannot use (the launcher exits 2 naming it)."""


def parse_secret(text: str, source: str = "webhook secret") -> bytes:
    """The key bytes of a ``whsec_<base64>`` secret."""
    text = text.strip()
    if not text.startswith(SECRET_PREFIX):
        raise WebhookConfigError(f"{source}: a webhook secret starts with {SECRET_PREFIX!r} "
                                 "(whsec_ + base64 of at least 24 random bytes)")
    try:
        key = base64.b64decode(text[len(SECRET_PREFIX):], validate=True)
    except ValueError:
        raise WebhookConfigError(f"{source}: the part after {SECRET_PREFIX!r} is not base64") from None
    if len(key) < 24:
        raise WebhookConfigError(f"{source}: the secret has {len(key)} bytes, at least 24 are needed")
    return key


def check_url(url: str, source: str = "webhook url") -> str:
    if not url.startswith(("http://", "https://")):
        raise WebhookConfigError(f"{source}: {url!r} is not an http:// or https:// URL")
    return url


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header value for one attempt."""
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def event_of(rec: JobRecord) -> dict[str, Any] | None:
    """The event a final record announces (None for a record that is not final)."""
    kind = EVENT_TYPES.get(rec.status)
    if kind is None:
        return None
    return {"id": f"evt_{uuid.uuid4().hex}", "object": "event",
            "created_at": rec.completed_at or int(time.time()), "type": kind, "data": {"id": rec.id}}


@dataclass(frozen=True)
class Target:
    url: str
    key: bytes = field(repr=False)

    @classmethod
    def of(cls, spec: dict[str, str], source: str) -> Target:
        """From ``{"url", "secret"}`` (the config's plain form)."""
        if not spec.get("url") or not spec.get("secret"):
            raise WebhookConfigError(f"{source}: a webhook needs both a URL and a secret")
        return cls(check_url(spec["url"], source), parse_secret(spec["secret"], source))


@dataclass(order=True)
class _Delivery:
    due: float
    seq: int
    target: Target = field(compare=False)
    msg_id: str = field(compare=False)
    body: bytes = field(compare=False)
    kind: str = field(compare=False)
    attempt: int = field(default=0, compare=False)


class Webhooks:
    """The instance's target and each owner's; ``on_final`` queues, sender threads deliver."""

    def __init__(self, instance: Target | None = None, by_owner: dict[str, Target] | None = None, *,
                 queue_size: int = 1000, timeout_s: float = 10.0, max_attempts: int = 8,
                 backoff_s: float = 1.0, max_backoff_s: float = 300.0, senders: int = 2) -> None:
        self.instance = instance
        self.by_owner = dict(by_owner or {})
        self.queue_size, self.timeout_s = queue_size, timeout_s
        self.max_attempts, self.backoff_s, self.max_backoff_s = max_attempts, backoff_s, max_backoff_s
        self._heap: list[_Delivery] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self.sent = 0
        self.failures: dict[str, int] = {}  # reason -> count (the metric's, readable in tests)
        self._threads = [threading.Thread(target=self._send_loop, name=f"dloserve-webhook-{i}", daemon=True)
                         for i in range(senders)]
        for t in self._threads:
            t.start()

    @classmethod
    def from_config(cls, spec: dict[str, Any] | None, **kwargs: Any) -> Webhooks | None:
        """From ``{"url", "secret", "keys": {owner: {"url", "secret"}}}``; None when it names none."""
        spec = spec or {}
        instance = Target.of(spec, "webhook") if spec.get("url") else None
        owners = {o: Target.of(s, f"webhook of key {o}") for o, s in (spec.get("keys") or {}).items()}
        if instance is None and not owners:
            return None
        return cls(instance, owners, **kwargs)

    def targets(self, owner: str | None) -> list[Target]:
        own = self.by_owner.get(owner) if owner is not None else None
        return [t for t in (self.instance, own) if t is not None]

    def on_final(self, rec: JobRecord) -> None:
        """Queue the event of a record that just became final, for each of its targets;
        never blocks and never raises (a full queue drops it and counts it)."""
        event = event_of(rec)
        targets = self.targets(rec.owner)
        if event is None or not targets:
            return
        body = json.dumps(event, separators=(",", ":")).encode()
        with self._cv:
            for t in targets:
                if self._closed or len(self._heap) >= self.queue_size:
                    self._failed("queue_full", event["type"])
                    log.warning("webhook queue full: %s for %s to %s dropped", event["type"], rec.id, t.url)
                    continue
                heapq.heappush(self._heap, _Delivery(time.monotonic(), next(self._seq), t, event["id"], body,
                                                     event["type"]))
            self._cv.notify_all()

    @property
    def pending(self) -> int:
        with self._cv:
            return len(self._heap)

    def close(self, timeout_s: float = 5.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=timeout_s)

    # -- sender threads ----------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (not self._heap or self._heap[0].due > time.monotonic()):
                    self._cv.wait(None if not self._heap else max(0.0, self._heap[0].due - time.monotonic()))
                if self._closed:
                    return
                d = heapq.heappop(self._heap)
            reason = self._attempt(d)
            if reason is None:
                with self._cv:
                    self.sent += 1
                continue
            d.attempt += 1
            self._failed(reason, d.kind)
            if d.attempt >= self.max_attempts:
                log.warning("webhook %s to %s given up after %d attempts (%s)", d.msg_id, d.target.url,
                            d.attempt, reason)
                self._failed("given_up", d.kind)
                continue
            d.due = time.monotonic() + min(self.max_backoff_s, self.backoff_s * 2 ** (d.attempt - 1))
            with self._cv:
                heapq.heappush(self._heap, d)
                self._cv.notify_all()

    def _attempt(self, d: _Delivery) -> str | None:
        """POST once; None on a 2xx, else why not (the metric's ``reason``)."""
        ts = int(time.time())
        req = urllib.request.Request(d.target.url, data=d.body, method="POST", headers={
            "content-type": "application/json", "user-agent": "dloserve-webhooks",
            "webhook-id": d.msg_id, "webhook-timestamp": str(ts),
            "webhook-signature": sign(d.target.key, d.msg_id, ts, d.body)})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:  # noqa: S310 - operator's URL
                return None if 200 <= r.status < 300 else f"http_{r.status // 100}xx"
        except urllib.error.HTTPError as e:
            return f"http_{e.code // 100}xx"
        except TimeoutError:
            return "timeout"
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            return "timeout" if isinstance(reason, TimeoutError) else "connection"

    def _failed(self, reason: str, kind: str) -> None:
        with self._cv:
            self.failures[reason] = self.failures.get(reason, 0) + 1
        try:
            from service.engine.metrics import metrics

            metrics()["webhook_failures"].inc(1, tags={"reason": reason, "type": kind})
        except Exception:  # noqa: BLE001 - no metrics (no Ray in this process): the count above stays
            pass
