"""A rank's batch: several requests of one batch key share each forward (engine/batching.py).

Part of ``RankWorker`` (engine/rank.py), kept apart. The lock-step unit stays one transformer
forward: a batched forward makes the same gathers as any other, so the group's ticks, idle
replays and expert agreement are untouched; only what one rank computes in its forward grows.

- The pipeline thread becomes the batch's *driver*: each member job runs its own pipeline
  (text encoding, its scheduler steps, its VAE decode) in a thread of its own, its denoiser
  a ``Joined`` whose calls wait on the ``Board`` (models/batch.py). Before every forward the
  driver admits the inbox's head while it has the batch's key and the batch is under its cap,
  waits until every member's next call is on the board (one still encoding its prompt: up to
  ``head_wait_s``), and runs them as one forward through the gate.
- Members join and leave at forward boundaries: a member whose forwards are done leaves (its
  decode runs in its thread beside the next forwards); a cancelled or preempted one is
  answered ``JobCancelled`` instead of joining the next forward, the others go on. Every
  member of the forward at the gate cancelled: the gate aborts, as for one request.
- The batch ends when no member forwards and the inbox's head is not of its key (or empty):
  that job starts next, so a stream of one key cannot starve another.

Which jobs share which forwards depends on when they arrive; a job's bytes depend on that
composition only (docs/service.md). A job whose cap is 1 never comes here.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from service.models.batch import Board, Joined

from .batching import batch_cap, batch_key
from .events import Event, EventKind
from .job import Job, JobCancelled, Member, Phase, sticky_error


class BatchDriver:
    """The batch half of ``RankWorker`` (its state is declared there)."""

    def _cap(self: Any, req: object) -> int:
        """Requests that may share ``req``'s forwards here (1: it runs alone, as before)."""
        adapter = self.runner.adapter
        if self.sequence_parallel or self.experts > 1 or adapter.staged or adapter.streamed:
            return 1  # SP all-to-alls, an expert switch, one staged VAE: one request at a time
        return batch_cap(req, self.runner.config)

    def _start_member(self: Any, job: Job) -> None:
        """``job`` joins the batch: its thread starts its pipeline (the caller holds ``_cv``)."""
        if self._board is None:
            self._board = Board(self._cv)
        member = Member(job, Joined(self.runner.transformer, self._board, job.id),
                        self.runner.adapter.forwards(job.req), {"start": time.monotonic()})
        self._members[job.id] = member
        self._live.add(job.id)
        self._heads.add(job.id)
        self._phase = Phase.HEAD
        self._emit(Event(EventKind.STARTED, rank=self.rank, job_id=job.id,
                         not_resumable=self._not_resumable(job.req)))
        t = threading.Thread(target=self._member_main, args=(member,), name=f"rank{self.rank}-{job.id}",
                             daemon=True)
        self._member_threads = [x for x in self._member_threads if x.is_alive()] + [t]
        t.start()

    def _member_main(self: Any, member: Member) -> None:
        self._bind_device()
        self._local.job = member.job
        with member.denoiser._board.solo:  # its host work takes turns with the others' (models/batch.py)
            self._run(member.job, member)

    def _drive(self: Any, first: Job) -> None:
        """Run the batch ``first`` began until none of its members forwards."""
        key, cap = batch_key(first.req, self.runner.config), self._cap(first.req)
        board = self._board
        assert board is not None
        try:
            with self.runner.applied(first.req):  # the key makes it the same for every member
                while True:
                    with self._cv:
                        ids = self._gather(board, key, cap)
                        if not ids:
                            return
                        calls = board.take(ids)
                        self._heads.difference_update(ids)
                        now = time.monotonic()
                        for i in ids:
                            self._members[i].marks.setdefault("first_gate", now)
                        self._gate_ids = ids
                    try:
                        board.run(self.runner.transformer, ids, calls)
                    except JobCancelled:
                        pass  # every member of it was cancelled at the gate: they end cancelled
                    except Exception as e:  # noqa: BLE001 - the members fail with it (board.run told them)
                        if sticky_error(e):
                            return  # their threads take the rank out (RankWorker._run)
                    else:
                        with self._cv:
                            self._counted(ids)
                    finally:
                        with self._cv:
                            self._gate_ids = []
        finally:
            with self._cv:
                self._phase = Phase.IDLE
                self._cv.notify_all()

    def _counted(self: Any, ids: list[str]) -> None:
        """After a forward of ``ids`` (``_cv`` held): a member whose forwards are done leaves."""
        for i in ids:
            m = self._members.get(i)
            if m is None:
                continue
            m.done += 1
            m.most = max(m.most, len(ids))
            if m.done >= m.expected:
                m.marks["forwards_done"] = time.monotonic()
                del self._members[i]
                self._emit(Event(EventKind.FORWARDS_DONE, rank=self.rank, job_id=i))

    def _gather(self: Any, board: Board, key: str | None, cap: int) -> list[str]:
        """The members of the next forward (``_cv`` held; [] when the batch is over)."""
        since = time.monotonic()
        while True:
            if self._closed:
                board.answer(list(board.pending), RuntimeError(f"rank {self.rank} closed during a request"))
                return []
            while self._inbox and len(self._members) < cap and self._joins(self._inbox[0], key):
                self._start_member(self._inbox.popleft())
            stop = [i for i in self._members if i in board.pending and i in self._cancel]
            if stop:
                board.take(stop)
                board.answer(stop, JobCancelled())  # they leave before this forward
            waiting = [i for i in self._members if i in board.pending]
            heads = [i for i in self._members if i in self._heads and i not in board.pending]
            busy = [i for i in self._members if i not in board.pending]
            if not self._members:
                return []
            if waiting and (not busy or (len(busy) == len(heads)
                                         and time.monotonic() - since >= self.head_wait_s)):
                return waiting
            self._phase = Phase.HEAD if heads else Phase.BETWEEN
            self._cv.notify_all()
            self._cv.wait(timeout=0.05 if heads else 1.0)

    def _joins(self: Any, job: Job, key: str | None) -> bool:
        return batch_key(job.req, self.runner.config) == key and self._cap(job.req) > 1

    def _left(self: Any, member: Member, marks: dict[str, float]) -> None:
        """``member``'s pipeline ended (``_cv`` held); failed or cancelled before its last
        forward, it leaves the batch here."""
        marks["batch_size"] = member.most
        self._heads.discard(member.job.id)
        if self._members.pop(member.job.id, None) is not None:
            marks.setdefault("forwards_done", marks["frames"])
            self._emit(Event(EventKind.FORWARDS_DONE, rank=self.rank, job_id=member.job.id))
