"""Driving RankWorkers by hand in the spawned-rank tests (what an executor does for real)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from service.engine.events import Event, EventKind
from service.engine.rank import RankWorker
from service.models.request import GenerationRequest


def run_one(worker: RankWorker, job_id: str | None, req: GenerationRequest | None) -> Event | None:
    """Tick until the group is idle; with a request, also wait for its FINISHED event (every
    rank of the group calls this at once; a rank without a request passes None)."""
    result: list[Event] = []
    done = threading.Event()

    def pump() -> None:
        while not done.is_set():
            for e in worker.events(0.5):
                if e.kind is EventKind.FINISHED and e.job_id == job_id:
                    result.append(e)
                    done.set()

    if job_id is not None and req is not None:
        worker.assign(job_id, req)
        threading.Thread(target=pump, name="events", daemon=True).start()
    worker.serve()
    if job_id is None:
        return None
    done.wait()
    return result[0]


def collect(worker: RankWorker, want: set[str], on_event: Callable[[Event], None] | None = None,
            ) -> dict[str, dict[EventKind, Event]]:
    """Events by job and kind (STARTED, FINISHED) until every job in ``want`` finished."""
    got: dict[str, dict[EventKind, Event]] = {}
    while not want <= {j for j, ev in got.items() if EventKind.FINISHED in ev}:
        for e in worker.events(0.5):
            if on_event is not None:
                on_event(e)
            if e.kind in (EventKind.STARTED, EventKind.FINISHED):
                got.setdefault(e.job_id, {})[e.kind] = e
    return got
