"""Who a queued request belongs to, what each owner may hold, and whose turn it is.

A tenant is an API key's owner id (None when the service has no keys: one tenant). Both
schedulers ask ``Tenants`` two things: may this tenant queue one more (its ``max_queued``;
``QuotaExceeded`` otherwise, a 429 about the caller's own quota, not the global bound),
and in which order do tenants get a free rank. The order is the tenant with the fewest
requests on ranks first, then the one served longest ago: a key with 70 queued requests
gets a rank no sooner than a key whose first request is waiting, so that one waits at
most until some rank frees (one request's time). Within a tenant the schedulers keep
their own rules (cost and starvation for continuous, compatibility keys for waves).

Pure Python; the counts change only under the dispatcher's lock.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Quota:
    """Per-tenant bounds; None: no bound of its own (the global queue and the ranks bound it).
    ``min_priority``: the best (lowest) priority its requests may ask for (checked at the
    edge: 422 naming ``priority``), so a key cannot promote itself past what it was given."""

    max_queued: int | None = None
    max_running: int | None = None
    min_priority: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_queued", "max_running"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or unset), got {value}")


class QuotaExceeded(Exception):
    """The caller's own queue is full: 429 naming its limit, with ``retry_after_s``."""

    def __init__(self, queued: int, limit: int, retry_after_s: int) -> None:
        super().__init__(f"this API key has {queued} jobs queued, its limit (max_queued {limit}); "
                         f"retry after {retry_after_s}s")
        self.queued, self.limit, self.retry_after_s = queued, limit, retry_after_s

    def __reduce__(self) -> tuple[type, tuple[int, int, int]]:
        return type(self), (self.queued, self.limit, self.retry_after_s)


@dataclass
class Tenants:
    """Quotas by tenant and the running counts that decide whose turn it is."""

    default: Quota = field(default_factory=Quota)
    overrides: dict[str | None, Quota] = field(default_factory=dict)
    running: Counter[str | None] = field(default_factory=Counter)
    _served: dict[str | None, int] = field(default_factory=dict)  # tenant -> turn it last got a rank
    _turn: int = 0

    def quota(self, tenant: str | None) -> Quota:
        return self.overrides.get(tenant, self.default)

    def admit(self, tenant: str | None, queued: int, latency_s: float) -> None:
        """QuotaExceeded if ``tenant`` already has its ``max_queued`` requests waiting."""
        limit = self.quota(tenant).max_queued
        if limit is not None and queued >= limit:
            raise QuotaExceeded(queued, limit, self.retry_after_s(tenant, latency_s))

    def retry_after_s(self, tenant: str | None, latency_s: float) -> int:
        """About when one of the tenant's queued requests starts (freeing a slot of its
        quota): one of its running requests ends, ~ latency / how many it runs."""
        return max(1, math.ceil(latency_s / max(1, self.running[tenant])))

    def may_run(self, tenant: str | None, extra: int = 0) -> bool:
        limit = self.quota(tenant).max_running
        return limit is None or self.running[tenant] + extra < limit

    def order(self, tenants: Iterable[str | None]) -> list[str | None]:
        """Fewest on ranks first, then the one served longest ago (never served: first)."""
        return sorted(set(tenants), key=lambda t: (self.running[t], self._served.get(t, -1), str(t)))

    def started(self, tenant: str | None) -> None:
        self.running[tenant] += 1
        self._turn += 1
        self._served[tenant] = self._turn

    def finished(self, tenant: str | None) -> None:
        if self.running[tenant] > 0:
            self.running[tenant] -= 1
        if not self.running[tenant]:
            del self.running[tenant]
