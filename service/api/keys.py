"""API keys: the key file's format, who a caller is, and what an anonymous caller may see.

Only SHA-256 hashes of keys reach the Serve config; a caller's owner id (what job records
store, and the tenant the scheduler shares ranks between) is the first 16 hex digits of
its key's hash. Two kinds of key: API keys (``--api-key``, ``--api-key-file``,
``DLOSERVE_API_KEYS``) own jobs; admin keys (``--admin-key``, ``--admin-key-file``) read
what concerns every tenant (``/readyz``'s detail, every key's ``/v1/waves``) and own none.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field

from service.api.errors import Answer, ApiError

QUOTA_OPTIONS = ("max_queued", "max_running")
PRIORITY_OPTION = "min_priority"  # the best priority the key's requests may ask for (any integer in range)
WEBHOOK_OPTIONS = ("webhook_url", "webhook_secret")


class AuthError(ApiError):
    """No or a wrong API key."""

    answer = Answer(401, "invalid_api_key", headers=(("WWW-Authenticate", "Bearer"),))


class KeyFileError(ValueError):
    """A key file line this version cannot read (the launcher exits 2 naming it)."""


@dataclass(frozen=True)
class KeyEntry:
    """One key and its quota overrides (``max_queued``, ``max_running``, ``min_priority``)."""

    key: str
    quota: dict[str, int] = field(default_factory=dict)
    webhook: dict[str, str] = field(default_factory=dict)  # {"url", "secret"}: this key's own events


def parse_key_lines(lines: Iterable[str], source: str = "key file") -> list[KeyEntry]:
    """``KEY`` or ``KEY max_queued=8 max_running=2 min_priority=-5`` per line, and
    ``webhook_url=URL webhook_secret=whsec_...`` for the key's own webhook; blank lines and
    lines that start with ``#`` are skipped. A key has no whitespace in it."""
    out = []
    for n, line in enumerate(lines, 1):
        words = (line.removeprefix("\ufeff") if n == 1 else line).split()  # a BOM is no part of a key
        if not words or words[0].startswith("#"):
            continue
        quota: dict[str, int] = {}
        webhook: dict[str, str] = {}
        for word in words[1:]:
            name, eq, value = word.partition("=")
            if eq and name in WEBHOOK_OPTIONS:
                webhook[name.removeprefix("webhook_")] = value
                continue
            if eq and name == PRIORITY_OPTION:
                quota[name] = _priority(value, f"{source}:{n}")
                continue
            if not eq or name not in QUOTA_OPTIONS or not value.isdigit() or int(value) < 1:
                raise KeyFileError(f"{source}:{n}: {word!r} is not one of "
                                   f"{', '.join(o + '=N' for o in QUOTA_OPTIONS)} (N >= 1), "
                                   "min_priority=N, webhook_url=URL, webhook_secret=whsec_...")
            quota[name] = int(value)
        if webhook:
            _check_webhook(webhook, f"{source}:{n}")
        out.append(KeyEntry(words[0], quota, webhook))
    return out


def _priority(value: str, where: str) -> int:
    from service.models.request import PRIORITY_RANGE

    lo, hi = PRIORITY_RANGE
    try:
        p = int(value)
    except ValueError:
        p = None
    if p is None or not lo <= p <= hi:
        raise KeyFileError(f"{where}: min_priority={value!r} must be an integer in [{lo}, {hi}] "
                           "(lower is served first)")
    return p


def _check_webhook(webhook: dict[str, str], where: str) -> None:
    from service.api.webhooks import Target, WebhookConfigError

    try:
        Target.of(webhook, where)
    except WebhookConfigError as e:
        raise KeyFileError(str(e)) from None


MIN_KEY_CHARS = 16  # shorter keys are accepted with a warning at start (guessable)


def short_keys(keys: Iterable[str]) -> int:
    """How many of ``keys`` are shorter than MIN_KEY_CHARS (the launcher warns; it does not
    refuse them, so a deployment's existing short keys keep working)."""
    return sum(len(k.strip()) < MIN_KEY_CHARS for k in keys)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.strip().encode()).hexdigest()


def owner_id(digest: str) -> str:
    """The owner id of a key's hash: what job records carry."""
    return digest[:16]


@dataclass(frozen=True)
class Caller:
    """Who asks: ``owner`` is the tenant (None for an open service); ``user`` whether the key
    may use the /v1 job routes; ``admin`` whether it reads every tenant's detail."""

    owner: str | None = None
    user: bool = False
    admin: bool = False


class Keys:
    """The accepted hashes, compared in constant time."""

    def __init__(self, api_hashes: list[str], admin_hashes: list[str] | None = None) -> None:
        self.api = list(api_hashes)
        self.admin = list(admin_hashes or [])

    @property
    def open(self) -> bool:
        """No API keys: every caller may use every job (one tenant)."""
        return not self.api

    @property
    def detail_public(self) -> bool:
        """Nothing to protect the service's detail with: no key of either kind."""
        return not self.api and not self.admin

    def caller(self, authorization: str | None) -> Caller:
        """Who the header says; anonymous (or a wrong key) is a Caller with no rights
        beyond those of an open service."""
        digest = _digest(authorization)
        admin = digest is not None and _known(digest, self.admin)
        if self.open:
            return Caller(None, user=True, admin=admin or self.detail_public)
        if digest is not None and _known(digest, self.api):
            return Caller(owner_id(digest), user=True, admin=admin)
        return Caller(None, user=False, admin=admin)

    def owner_of(self, authorization: str | None) -> str | None:
        """The caller's owner id for the /v1 job routes; AuthError if keys are on and the
        bearer token is missing or not an API key."""
        if self.open:
            return None
        digest = _digest(authorization)
        if digest is None:
            raise AuthError("Missing bearer authentication in header (Authorization: Bearer YOUR_KEY)")
        if not _known(digest, self.api):
            raise AuthError("Incorrect API key provided")
        return owner_id(digest)


def _digest(authorization: str | None) -> str | None:
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return key_hash(token)


def _known(digest: str, hashes: list[str]) -> bool:
    found = False
    for h in hashes:  # no early exit: the time does not tell which hash matched
        found |= hmac.compare_digest(h, digest)
    return found
