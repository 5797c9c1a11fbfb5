"""A front end's registered LoRA adapters: names per owner (API key), a cap, pages.

Names are scoped to their owner: two keys may both register ``style`` and each gets its
own; a key sees, uses and deletes only its own adapters and the server's (registered at
start with ``--lora``, owner None, usable by every key and deletable by none while keys
are on). A server name cannot be taken by a key (a request naming it would be ambiguous);
another key's names are never told, not even by a 409. Without keys every caller is owner
None: one namespace, as before.

What reaches a rank is not the name: ``resolve`` fills each ``LoraRef`` with the file's
path and the SHA-256 of the bytes checked, and the rank loads and caches by that digest
(``RankAdapters``). So two keys' ``style`` are two different adapters on the rank too,
and the name a ref keeps is only the caller's own, for its error messages.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .lora_ref import LoraError, LoraRef, name_problem
from .request import RequestError

if TYPE_CHECKING:  # torch loads with the first adapter read: a front end starts without it
    from .lora import Targets


class LoraLimit(Exception):
    """The owner has registered as many adapters as it may (409, naming ``name``)."""


@dataclass(frozen=True)
class Registered:
    """One registered adapter: where it is, the digest of the bytes checked, what it holds."""

    name: str
    source: str
    sha256: str
    summary: dict[str, Any]
    owner: str | None = None
    created_at: int = 0
    server: bool = True  # registered by the server at start (--lora), not by a caller

    def public(self) -> dict[str, Any]:
        """What the /v1/loras answers show (never the path: it is the server's business)."""
        return {"object": "lora", "id": self.name, "name": self.name, "sha256": self.sha256,
                "created_at": self.created_at, **self.summary}


class LoraRegistry:
    """A front end's adapters (the service, ``generate``), by owner and name.

    ``register`` reads and checks the whole file against the model's Linears (a bad file is
    refused here, before any request names it); ``resolve`` fills a request's refs with the
    source and digest, so the ranks need nothing else and the registry can change while
    resolved requests run. ``owners``: API keys are on (an owner sees only its own and the
    server's adapters).
    """

    def __init__(self, targets: Targets | Callable[[], Targets], owners: bool = False) -> None:
        # A callable is called at the first registration: a server without adapters never
        # builds the module or reads the checkpoint's header for them (its ranks do that).
        self._targets = targets
        self.owners = owners
        self._lock = threading.Lock()
        self._entries: dict[tuple[str | None, str], Registered] = {}  # (owner, name), in order

    @property
    def targets(self) -> Targets:
        if callable(self._targets):
            self._targets = self._targets()
        return self._targets

    def register(self, name: str, source: str, owner: str | None = None, limit: int | None = None
                 ) -> Registered:
        """Check and add. ``limit``: a caller's run-time registration, refused (LoraLimit) when
        ``owner`` has that many already; without it, the server's own. LoraError (bad file),
        KeyError (the name is taken for this owner)."""
        why = name_problem(name)
        if why:
            raise LoraError(str(name), "name", why)
        with self._lock:
            self._check_free(name, owner, limit)
        from .lora import read_adapter

        file = read_adapter(source, name, self.targets)
        entry = Registered(name, str(source), file.sha256, file.summary(), owner, int(time.time()),
                           server=limit is None)
        with self._lock:  # again: another registration may have come in during the read
            self._check_free(name, owner, limit)
            self._entries[(owner, name)] = entry
        return entry

    def _check_free(self, name: str, owner: str | None, limit: int | None) -> None:
        if (owner, name) in self._entries:
            raise KeyError(f"adapter {name!r} is already registered (DELETE /v1/loras/{name} first)")
        if owner is not None and (None, name) in self._entries:
            raise KeyError(f"adapter {name!r} is one of the server's (GET /v1/loras lists them): "
                           "choose another name")
        if limit is not None:
            mine = sum(1 for (o, _), e in self._entries.items() if o == owner and not e.server)
            if mine >= limit:
                raise LoraLimit(f"this key has {mine} adapters registered, the most it may have "
                                f"({limit}): DELETE /v1/loras/NAME one first")

    def get(self, name: str, owner: str | None = None) -> Registered | None:
        """The caller's own adapter ``name``, else the server's of that name."""
        with self._lock:
            return self._entries.get((owner, name)) or self._entries.get((None, name))

    def list(self, owner: str | None = None) -> list[Registered]:
        """The server's adapters and ``owner``'s, in registration order."""
        with self._lock:
            return [e for (o, _), e in self._entries.items() if not self.owners or o is None or o == owner]

    def page(self, owner: str | None, after: str | None, limit: int, order: str = "asc"
             ) -> tuple[list[Registered], bool]:
        """One page of ``list(owner)`` (``after`` a name it holds; an unknown one: an empty
        page, as GET /v1/videos answers), and whether more follow."""
        entries = self.list(owner)
        if order == "desc":
            entries.reverse()
        if after is not None:
            names = [e.name for e in entries]
            entries = entries[names.index(after) + 1:] if after in names else []
        return entries[:limit], len(entries) > limit

    def remove(self, name: str, owner: str | None = None) -> bool:
        """False if ``owner`` has no such adapter (another key's is never found; the server's
        are not removed while keys are on). Requests already resolved run on unchanged."""
        with self._lock:
            e = self._entries.get((owner, name))
            if e is None or (self.owners and e.owner is None):
                return False
            del self._entries[(owner, name)]
            return True

    def resolve(self, refs: tuple[LoraRef, ...], owner: str | None = None) -> tuple[tuple[LoraRef, ...], int]:
        """``refs`` with source and digest filled (what the rank loads, by digest), and their
        device bytes; RequestError naming an adapter the caller has not got."""
        out, nbytes = [], 0
        for i, r in enumerate(refs):
            e = self.get(r.name, owner)
            if e is None:
                raise RequestError(f"loras[{i}].name",
                                   f"unknown adapter {r.name!r} (GET /v1/loras lists them)")
            out.append(LoraRef(r.name, r.scale, r.expert, e.source, e.sha256))
            nbytes += int(e.summary["bytes"])
        return tuple(out), nbytes
