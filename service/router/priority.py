"""Priorities that preempt: which running requests pause so better-priority ones can run.

vLLM's convention: an integer ``priority``, lower is served first, 0 by default. The
continuous scheduler already starts the best priority queued whenever a rank frees
(scheduler.py); this decides when *not* to wait for one: while a queued request has a
better priority than a request some rank is forwarding, that request (the worst running
one) is paused at its next forward boundary (``Dispatcher.preempt``: its last per-step
state is kept, models/resume.py) and queued again; the urgent one takes the freed rank,
and the paused one goes on later from its step, with the same bytes.

Bounded, so nothing is paused forever: a request paused ``max_preemptions`` times is no
longer preemptible (it runs to its end), and one without a kept state (no step done yet,
or not resumable: another scheduler, a step cache, two experts) is never paused: it would
lose its work. One pause per waiting request: pauses already under way count as ranks
about to free.

Pure Python, like the schedulers: the dispatcher calls ``victims`` under its lock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_MAX_PREEMPTIONS = 2


@dataclass(frozen=True)
class Running:
    """A request a rank is forwarding, as the policy sees it (only preemptible ones)."""

    id: str
    priority: int
    preemptions: int
    assigned_at: float


def victims(waiting: Iterable[int], running: Iterable[Running], pausing: int,
            max_preemptions: int = DEFAULT_MAX_PREEMPTIONS) -> list[str]:
    """The ids to pause now. ``waiting``: the priorities of queued requests that could start
    on a free rank; ``running``: the preemptible requests on ranks; ``pausing``: pauses
    already asked for and not yet done (each frees a rank for the best waiting request).

    Each waiting request, best first, takes the worst running request of a strictly worse
    priority (of those, the one paused least often, then the latest started: it has held
    its rank the shortest)."""
    queue = sorted(waiting)[max(0, pausing):]
    pool = sorted((r for r in running if r.preemptions < max_preemptions),
                  key=lambda r: (-r.priority, r.preemptions, -r.assigned_at))
    out: list[str] = []
    for p in queue:
        if not pool or pool[0].priority <= p:
            break
        out.append(pool.pop(0).id)
    return out
