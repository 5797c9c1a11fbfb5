"""Which browsers' requests the service takes: ``Host`` and ``Origin`` checks.

- **Host.** A service bound to loopback answers only to loopback names (``127.0.0.1``,
  ``localhost``, ``::1``): a page on ``evil.example`` whose name is re-pointed at
  127.0.0.1 (DNS rebinding) reaches the port with ``Host: evil.example`` and is refused.
- **Origin.** A browser names the page that sends a request. A write (POST, DELETE, ...)
  from a page of another origin is refused: a cross-site form or ``text/plain`` post to a
  keyless service. The service's own /ui page is same-origin; clients that are not
  browsers (curl, httpx, the openai client) send no Origin and are not affected. Behind a
  proxy that rewrites Host, its ``X-Forwarded-Host`` (a header a cross-site page cannot
  set without a CORS preflight, which this service never allows) names the origin too.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def hostname(host: str) -> str:
    """``[::1]:8000`` -> ``::1``, ``LocalHost.:80`` -> ``localhost``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0].rstrip(".") if host.count(":") == 1 else host.rstrip(".")


def refusal(method: str, headers: Mapping[str, str], allowed_hosts: list[str]) -> tuple[str, str] | None:
    """(code, message) when the request is refused (403), None when it is taken."""
    host = headers.get("host", "")
    if allowed_hosts and hostname(host) not in allowed_hosts:
        return ("forbidden_host", f"Host {host!r} is not a name this service answers to "
                                  f"({', '.join(allowed_hosts)})")
    origin = headers.get("origin")
    if origin is None or method.upper() in SAFE_METHODS:
        return None
    netloc = urlsplit(origin).netloc.lower() if "://" in origin else ""
    same = {h.strip().lower() for h in (host, headers.get("x-forwarded-host", "")) if h.strip()}
    if netloc and netloc in same:
        return None
    return ("cross_origin", f"a write from the page at Origin {origin!r} is refused: it is not this "
                            "service's own origin")
