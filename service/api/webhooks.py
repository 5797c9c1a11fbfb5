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
least once and per target: each target (the instance's, each key's) has its own bounded
queue (a full one drops the event and counts it, it never blocks the caller) and its own
sender thread, so a receiver that is slow, failing or silent delays and fills only its own.
Each POST has a deadline for the whole request (``timeout_s``), follows no redirect, and goes
only to public addresses unless the operator allows private ones (webhook_http.py). Errors,
non-2xx answers and timeouts are retried with exponential backoff; after
``breaker_failures`` failures in a row a target rests (its breaker opens for ``breaker_s``,
doubling); failures are counted in ``dloserve_webhook_failures_total``. The queues live in
the store's memory: deliveries pending when its process dies are lost.
"""

from __future__ import annotations

import base64
import hashlib
import heapq
import hmac
import ipaddress
import itertools
import json
import logging
import math
import os
import stat
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from typing import Any

from service.api.records import JobRecord, JobStatus
from service.api.webhook_http import post

log = logging.getLogger("dloserve.webhooks")
EVENT_TYPES = {JobStatus.COMPLETED: "video.completed", JobStatus.FAILED: "video.failed",
               JobStatus.CANCELLED: "video.cancelled"}
SECRET_PREFIX = "whsec_"
FINAL_REASONS = ("redirect", "refused_address")  # no retry changes these answers


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


def warn_if_shared(path: str, what: str) -> bool:
    """Log a warning when a file holding secrets can be read by other users (its group or all);
    True if it was. Used still (an operator's choice), but never silently."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        log.warning("%s %s is readable by other users (mode %o): its secrets sign webhooks; chmod 600 it",
                    what, path, mode)
        return True
    return False


def warn_if_private(url: str, source: str) -> bool:
    """Log a warning when ``url`` names a loopback or private address outright (an IP, or
    localhost): without --webhook-allow-private each delivery to it is refused. (A name is
    checked at each connect only: what it resolves to may change.) True if it was."""
    host = urllib.parse.urlsplit(url).hostname or ""
    try:
        private = host == "localhost" or not ipaddress.ip_address(host).is_global
    except ValueError:
        return False
    if private:
        log.warning("%s %s is a private address: its deliveries are refused without --webhook-allow-private",
                    source, url)
    return private


def warn_of(settings: dict[str, Any], key_file: str | None) -> None:
    """At start (serve's flags, as ``webhook_settings`` made them): secrets others can read,
    and targets that name a private address the deliveries to which will be refused."""
    if settings.get("webhook_secret_file"):
        warn_if_shared(settings["webhook_secret_file"], "--webhook-secret-file")
    if settings.get("key_webhooks") and key_file:
        warn_if_shared(key_file, "--api-key-file (its webhook_secret= values)")
    if not settings.get("webhook_allow_private"):
        if settings.get("webhook_url"):
            warn_if_private(settings["webhook_url"], "--webhook-url")
        for hook in settings.get("key_webhooks", {}).values():
            warn_if_private(hook["url"], "a key's webhook_url")


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
    msg_id: str = field(compare=False)
    body: bytes = field(compare=False)
    kind: str = field(compare=False)
    attempt: int = field(default=0, compare=False)


class _Lane:
    """One target's own queue, sender thread and breaker: what one receiver does (answers
    slowly, fails, never answers) holds and fills only its own lane."""

    def __init__(self, target: Target, hooks: Webhooks) -> None:
        self.target, self.hooks = target, hooks
        self.heap: list[_Delivery] = []
        self.cv = threading.Condition()
        self.failed_in_a_row = 0
        self.open_until = 0.0  # the breaker: no attempt before this (monotonic)
        self.opened = 0  # times the breaker opened since the last delivery
        self.thread = threading.Thread(target=self.loop, name="dloserve-webhook", daemon=True)
        self.thread.start()

    def push(self, d: _Delivery) -> bool:
        with self.cv:
            if self.hooks.closed or len(self.heap) >= self.hooks.queue_size:
                return False
            heapq.heappush(self.heap, d)
            self.cv.notify_all()
            return True

    def _next_at(self) -> float:
        return max(self.heap[0].due, self.open_until) if self.heap else math.inf

    def loop(self) -> None:
        while True:
            with self.cv:
                while not self.hooks.closed and self._next_at() > time.monotonic():
                    wait = self._next_at() - time.monotonic()
                    self.cv.wait(None if wait == math.inf else max(0.0, wait))
                if self.hooks.closed:
                    return
                d = heapq.heappop(self.heap)
            self.deliver(d)

    def deliver(self, d: _Delivery) -> None:
        hooks = self.hooks
        reason = hooks._attempt(self.target, d)
        if reason is None:
            self.failed_in_a_row, self.opened = 0, 0
            with hooks.stats_lock:
                hooks.sent += 1
            return
        d.attempt += 1
        self.failed_in_a_row += 1
        hooks._failed(reason, d.kind)
        if reason in FINAL_REASONS or d.attempt >= hooks.max_attempts:
            log.warning("webhook %s to %s given up after %d attempts (%s)", d.msg_id, self.target.url,
                        d.attempt, reason)
            hooks._failed("given_up", d.kind)
            return
        now = time.monotonic()
        if self.failed_in_a_row >= hooks.breaker_failures:  # this receiver is down: rest it
            self.opened += 1
            self.failed_in_a_row = 0
            pause = min(hooks.max_backoff_s, hooks.breaker_s * 2 ** (self.opened - 1))
            self.open_until = now + pause
            hooks._failed("breaker_open", d.kind)
            log.warning("webhook target %s failed %d times in a row (%s): no attempt for %.0f s",
                        self.target.url, hooks.breaker_failures, reason, pause)
        d.due = now + min(hooks.max_backoff_s, hooks.backoff_s * 2 ** (d.attempt - 1))
        with self.cv:
            heapq.heappush(self.heap, d)
            self.cv.notify_all()


class Webhooks:
    """The instance's target and each owner's; ``on_final`` queues into each target's lane,
    whose own thread delivers."""

    def __init__(self, instance: Target | None = None, by_owner: dict[str, Target] | None = None, *,
                 queue_size: int = 1000, timeout_s: float = 10.0, max_attempts: int = 8,
                 backoff_s: float = 1.0, max_backoff_s: float = 300.0, breaker_failures: int = 5,
                 breaker_s: float = 30.0, allow_private: bool = False) -> None:
        self.instance = instance
        self.by_owner = dict(by_owner or {})
        self.queue_size, self.timeout_s = queue_size, timeout_s  # per target; the whole request's deadline
        self.max_attempts, self.backoff_s, self.max_backoff_s = max_attempts, backoff_s, max_backoff_s
        self.breaker_failures, self.breaker_s = breaker_failures, breaker_s
        self.allow_private = allow_private
        self._seq = itertools.count()
        self._lanes: dict[Target, _Lane] = {}
        self._lanes_lock = threading.Lock()
        self.stats_lock = threading.Lock()
        self.closed = False
        self.sent = 0
        self.failures: dict[str, int] = {}  # reason -> count (the metric's, readable in tests)

    @classmethod
    def from_config(cls, spec: dict[str, Any] | None, **kwargs: Any) -> Webhooks | None:
        """From ``{"url", "secret", "keys": {owner: {"url", "secret"}}, "allow_private"}``; None
        when it names no target."""
        spec = spec or {}
        instance = Target.of(spec, "webhook") if spec.get("url") else None
        owners = {o: Target.of(s, f"webhook of key {o}") for o, s in (spec.get("keys") or {}).items()}
        if instance is None and not owners:
            return None
        kwargs.setdefault("allow_private", bool(spec.get("allow_private")))
        return cls(instance, owners, **kwargs)

    def targets(self, owner: str | None) -> list[Target]:
        own = self.by_owner.get(owner) if owner is not None else None
        return [t for t in (self.instance, own) if t is not None]

    def _lane(self, target: Target) -> _Lane:
        with self._lanes_lock:
            lane = self._lanes.get(target)
            if lane is None:
                lane = self._lanes[target] = _Lane(target, self)
            return lane

    def on_final(self, rec: JobRecord) -> None:
        """Queue the event of a record that just became final, for each of its targets;
        never blocks and never raises (a target's full queue drops it and counts it)."""
        event = event_of(rec)
        targets = self.targets(rec.owner)
        if event is None or not targets:
            return
        body = json.dumps(event, separators=(",", ":")).encode()
        for t in targets:
            d = _Delivery(time.monotonic(), next(self._seq), event["id"], body, event["type"])
            if not self._lane(t).push(d):
                self._failed("queue_full", event["type"])
                log.warning("webhook queue of %s full: %s for %s dropped", t.url, event["type"], rec.id)

    @property
    def pending(self) -> int:
        with self._lanes_lock:
            lanes = list(self._lanes.values())
        return sum(len(lane.heap) for lane in lanes)

    def close(self, timeout_s: float = 5.0) -> None:
        self.closed = True
        with self._lanes_lock:
            lanes = list(self._lanes.values())
        for lane in lanes:
            with lane.cv:
                lane.cv.notify_all()
        for lane in lanes:
            lane.thread.join(timeout=timeout_s)

    def _attempt(self, target: Target, d: _Delivery) -> str | None:
        """POST once (webhook_http.post: a deadline for all of it, no redirects, checked
        addresses); None on a 2xx, else why not (the metric's ``reason``)."""
        ts = int(time.time())
        headers = {"content-type": "application/json", "user-agent": "dloserve-webhooks",
                   "webhook-id": d.msg_id, "webhook-timestamp": str(ts),
                   "webhook-signature": sign(target.key, d.msg_id, ts, d.body)}
        return post(target.url, d.body, headers, self.timeout_s, self.allow_private)

    def _failed(self, reason: str, kind: str) -> None:
        with self.stats_lock:
            self.failures[reason] = self.failures.get(reason, 0) + 1
        try:
            from service.engine.metrics import metrics

            metrics()["webhook_failures"].inc(1, tags={"reason": reason, "type": kind})
        except Exception:  # noqa: BLE001 - no metrics (no Ray in this process): the count above stays
            pass
