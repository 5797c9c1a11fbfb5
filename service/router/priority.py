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
or not resumable: sequence parallel, models/loop.py) is never paused: it would
lose its work. One pause per waiting request: pauses already under way count as ranks
about to free.

Waves (``--scheduler waves``): a wave's group frees only when all its requests end, so one
pause frees nothing; a better request waiting pauses a whole wave instead (``wave_victims``),
and only one whose every request is strictly worse and preemptible; one wave at a time.

Pure Python, like the schedulers: the dispatcher calls these under its lock.
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


def wave_victims(waiting: Iterable[int], waves: Iterable[list[Running | None]], pausing: int,
                 max_preemptions: int = DEFAULT_MAX_PREEMPTIONS) -> list[str]:
    """Waves scheduling: the ids of the one wave to pause now, or none. ``waves``: per busy
    group, the requests it forwards (None for one that cannot be paused: no state kept);
    ``pausing``: pauses under way (then none: their group frees first). A wave is paused
    only when all its requests are preemptible and strictly worse than the best waiting
    one; of those, the one whose best priority is the worst (then the latest started)."""
    best = min(waiting, default=None)
    if pausing or best is None:
        return []
    whole = [[r for r in w if r is not None] for w in waves if w and None not in w]
    fit = [w for w in whole if all(r.priority > best and r.preemptions < max_preemptions for r in w)]
    if not fit:
        return []
    worst = max(fit, key=lambda w: (min(r.priority for r in w), max(r.assigned_at for r in w)))
    return [r.id for r in worst]
