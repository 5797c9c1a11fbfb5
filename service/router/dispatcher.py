"""The loop that turns queued requests into waves on one DP group.

A plain thread (the engine is synchronous Ray calls), shared by the HTTP ingress and the
batch job so both run exactly the same scheduling. It guarantees every accepted request
ends: a wave completes or fails (dead rank, rank error, deadline) and a group that cannot
be rebuilt fails the waves that reach it instead of holding them forever.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from service.engine.group import DPGroup, Outcome
from service.engine.metrics import metrics
from service.router.policy import DeadlinePolicy
from service.router.waves import Ticket, Wave, WaveRouter

log = logging.getLogger("dloserve.router")


class Sink(Protocol):
    """Where job state goes (the HTTP job store, the batch manifest)."""

    def on_start(self, ticket: Ticket, wave: dict[str, Any]) -> None: ...

    def on_progress(self, ticket_id: str, step: int, total: int) -> None: ...

    def on_finish(self, ticket: Ticket, outcome: Outcome, wave: dict[str, Any]) -> None: ...


@dataclass
class Dispatcher:
    """Owns the router and the group; ``submit`` from any thread, waves run on one thread."""

    group: DPGroup
    router: WaveRouter
    sink: Sink
    deadlines: DeadlinePolicy = field(default_factory=DeadlinePolicy)
    retry_s: float = 5.0
    history: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=256))
    _cv: threading.Condition = field(default_factory=threading.Condition)
    _stop: bool = False
    _thread: threading.Thread | None = None
    waves_run: int = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="dloserve-dispatch", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self.group.close()

    def submit(self, ticket_id: str, key: str, payload: Any) -> Ticket:
        """Queue one validated request; raises QueueFull when the bound is reached."""
        with self._cv:
            t = self.router.submit(ticket_id, key, payload)
            self._depth()
            self._cv.notify_all()
            return t

    def cancel(self, ticket_id: str) -> bool:
        with self._cv:
            ok = self.router.cancel(ticket_id)
            self._depth()
            return ok

    @property
    def depth(self) -> int:
        return self.router.depth

    # -- the loop ----------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.group.start()
        except Exception:  # noqa: BLE001 - the loop must live on: waves fail with the reason
            log.exception("DP group failed to start")
        while True:
            with self._cv:
                if self._stop:
                    return
                wave = self.router.next_wave()
                if wave is None:
                    # Wake at least every second: Ray expires gauges not re-set for ~2 s.
                    wake = self.router.wake_in()
                    self._cv.wait(timeout=1.0 if wake is None else min(wake, 1.0))
                    self._depth()
                    continue
                self._depth()
            try:
                self._dispatch(wave)
            except Exception as e:  # noqa: BLE001 - never let the loop die with tickets in hand
                log.exception("wave dispatch crashed")
                self._fail(wave, f"internal error: {e}", {"reason": wave.reason})

    def _dispatch(self, wave: Wave) -> None:
        if self.group.state != "ready" and not self._recover():
            why = f"DP group unavailable: {self.group.last_error or self.group.state}"
            self._fail(wave, why, {"reason": wave.reason})
            time.sleep(self.retry_s)  # the next wave retries the rebuild
            return
        reqs = [t.payload for t in wave.tickets]
        deadline = self.deadlines.deadline_s(reqs)
        record = {
            "wave": self.waves_run,
            "key": wave.key,
            "size": wave.size,
            "reason": wave.reason,
            "ids": [t.id for t in wave.tickets],
            "generation": self.group.generation,
            "deadline_s": round(deadline, 1),
            "started_at": time.time(),
        }
        self.waves_run += 1
        for t in wave.tickets:
            self.sink.on_start(t, record)

        def progress(rank: int, step: int, total: int) -> None:
            self.sink.on_progress(wave.tickets[rank].id, step, total)

        t0 = time.monotonic()
        outcomes = self.group.run_wave(reqs, deadline, progress)
        record["latency_s"] = round(time.monotonic() - t0, 3)
        record["ok"] = all(o.ok for o in outcomes)
        record["errors"] = sorted({o.error for o in outcomes if o.error})
        self.router.record_wave_latency(record["latency_s"])
        self.history.append(record)
        for t, o in zip(wave.tickets, outcomes, strict=True):
            self.sink.on_finish(t, o, record)
        if self.group.state == "broken":
            self._recover()

    def _recover(self) -> bool:
        """Rebuild a broken or failed group (new actors, new process group)."""
        if self.group.state == "closed":
            return False
        return self.group.rebuild(self.group.last_error or self.group.state)

    def _fail(self, wave: Wave, why: str, record: dict[str, Any]) -> None:
        for t in wave.tickets:
            self.sink.on_finish(t, Outcome(-1, error=why), record)

    def _depth(self) -> None:
        metrics()["queue_depth"].set(self.router.depth, tags={"group": self.group.group_id})
        self.group.refresh_gauges()
