"""One rank's serving loop: an inbox, a pipeline thread, a forward gate and the tick protocol.

No Ray here. The Ray actor (worker.py), the local N-process launcher (local.py) and so
the service, the batch job and ``dloserve generate`` all drive ranks through this one
class, as vLLM's executors share one worker.

The lock-step unit is one transformer forward. Every forward makes the same gathers
whatever the request's shape, so in one *tick* each rank of a group either lets its own
request's next forward through the gate or replays the gathers of one forward idle. Before
every tick the ranks agree, over a small gloo group, on two bits: does anyone have a
forward waiting, and does anyone have work at all. No forward waiting but work somewhere
(a text encoder still running) is a null tick: nobody gathers, everyone asks again. Nobody
with work ends ``serve``. So a rank whose request ends starts the next one at the next
forward boundary, and requests of any size, step count or CFG setting share a group.

Two experts (Wan2.2 A14B): a tick runs one expert's forward; the agreement also says which
(the one most ranks need) and which the next tick will need, so the ring prefetches across
the switch. A rank at the gate with the other expert holds: it replays the tick idle and
keeps its forward (engine/experts.py has the rule and why).

Sequence parallel (``sequence_parallel=True``): the group is one SP group and every rank
holds the same request, each running all its forwards on 1/S of the tokens. Attention
all-to-alls cannot be replayed idle, so a tick runs only when *every* rank is at the gate
(otherwise it is a null tick), and only the lead rank encodes and reports the MP4.

Cancel: a cancelled request that is queued leaves the inbox; one that is running stops at
its next forward boundary. The tick thread decides it (never the pipeline thread on its
own, which could leave a gate the group already opened): instead of opening the gate it
tells the pipeline thread to abort, and the rank replays that tick idle like any free rank.

Batches (engine/rank_batch.py): where ``--max-batch-size`` and the cost model allow
(engine/batching.py), requests of one batch key share each forward of this rank; the tick
protocol is the same, a batched forward makes the same gathers as any other.

A sticky failure (a CUDA or collective error: the device or the group cannot be trusted
again) fails the request and takes the rank out: RANK_FAILED, and it takes no more work.

Threads of a rank:
- the pipeline thread takes requests from the inbox one at a time: text encoding (HEAD),
  forwards through the gate, VAE decode (TAIL) whose chunks go to an MP4 encoder process
  as they come (engine.tail), then takes the next request while x264 finishes;
- the caller of ``serve`` (the tick thread) runs the agreement, opens the gate or replays;
- anyone may call ``assign``, ``events`` (long poll) and ``ping`` meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from service.models.batch import Board
from service.models.pipeline import PipelineRunner
from service.models.request import GenerationRequest

from .encoder import Encoder
from .events import Event, EventKind
from .experts import NONE, Tick, agree, needs
from .job import Job, JobCancelled, Member, Phase, sticky_error  # noqa: F401 - sticky_error: the tests' name
from .preview import Previewer
from .rank_batch import BatchDriver
from .state import StateTap
from .tail import Handoff


class RankWorker(BatchDriver):
    """Rank ``rank`` of a group of ``world`` ranks that make the same gathers per forward.

    ``control`` is a gloo group of the same ranks (None for a single rank): the per-tick
    agreement goes over it, on the CPU, so it never queues behind GPU work.
    """

    def __init__(
        self,
        runner: PipelineRunner,
        rank: int = 0,
        world: int = 1,
        control: dist.ProcessGroup | None = None,
        encoder: Encoder | None = None,
        head_wait_s: float = 1.0,
        on_report: Callable[[], None] | None = None,
        report_every_s: float = 5.0,
        sequence_parallel: bool = False,
        lead: bool = True,
    ) -> None:
        if world > 1 and control is None:
            raise ValueError("a group of several ranks needs a control group")
        self.runner = runner
        self.rank, self.world, self.control = rank, world, control
        self.sequence_parallel, self.lead = sequence_parallel, lead
        self.encoder = encoder or Encoder(0)
        self.tap = StateTap()  # each step's state of a resumable request, to the driver (engine.state)
        self.head_wait_s = head_wait_s
        # Offload counters are read on the tick thread, between forwards: no fill is being
        # issued then, so reading them races with nothing.
        self.on_report = on_report
        self.report_every_s = report_every_s
        self._reported = time.monotonic()
        self._cv = threading.Condition()
        self._inbox: deque[Job] = deque()
        self._phase = Phase.IDLE
        self._current: Job | None = None
        self._go = False
        self._done_forwards = 0  # of the current request
        self._expected = 0  # forwards the current request makes
        self._cancel: set[str] = set()  # running jobs to stop at their next forward boundary or chunk
        self._encoding: dict[str, Handoff] = {}  # jobs whose MP4 is still being encoded
        self._live: set[str] = set()  # jobs in the pipeline (ours or a batch member's thread) until decoded
        self._abort = False  # tick thread -> pipeline thread: leave the gate, the job is cancelled
        self._stopped = False  # the pipeline thread left the gate on an abort (no forward ran)
        self._failed: str | None = None  # a sticky error took this rank out
        self._marks: dict[str, float] = {}  # monotonic times of the current job's stages
        self._members: dict[str, Member] = {}  # the running batch's jobs still forwarding
        self._gate_ids: list[str] = []  # the jobs of the batched forward at the gate
        self._local = threading.local()  # a batch member's thread: its job (the preview's)
        self._member_threads: list[threading.Thread] = []
        self._board: Board | None = None  # where the batch members' denoiser calls wait
        self._heads: set[str] = set()  # members that have not made their first call yet
        self._events: list[Event] = []
        self._closed = False
        self.start_stages: dict[str, float] = {}  # seconds per set-up stage (engine.start)
        self.ticks = 0  # ticks this rank took part in, real or idle
        self.forwards = 0
        self.idle_ticks = 0
        self.null_ticks = 0
        self.agree_s = 0.0  # time spent in the per-tick agreement
        self.tick_log: deque[str] = deque(maxlen=4096)  # per tick: the job that ran, "" if idle
        self.experts = len(runner.experts)  # 2: the tick agrees which expert runs (engine.experts)
        runner.tick_driven = self.experts > 1
        self.held_ticks = 0  # ticks this rank was at the gate with the expert the tick did not run
        self._gate_expert = 0
        self._needs = (NONE, NONE, NONE)  # (at the gate, after running it, if not running)
        dev = runner.device
        self._cuda_index = (dev.index if dev.index is not None else torch.cuda.current_device()) \
            if dev.type == "cuda" else None
        self._hooks = []
        for expert, module in enumerate(runner.experts):
            # First of the pre-hooks: a forward the gate stops (cancel) never begins, so the
            # offload's own hooks neither start it nor replay its gathers.
            gate = partial(self._gate_enter, expert)
            self._hooks.append(module.register_forward_pre_hook(gate, prepend=True))
            self._hooks.append(module.register_forward_hook(self._gate_leave, always_call=True))
        if control is not None and not sequence_parallel:
            runner.caches.agree_over(control)  # step-cache decisions: one CPU all-reduce, no device sync
        self.previewer = Previewer(self._emit_locked, rank) if lead else None
        runner.adapter.latents_hook = self._on_latents if lead else None
        self._thread = threading.Thread(target=self._pipeline_loop, name=f"rank{rank}-pipeline",
                                        daemon=True)
        self._thread.start()

    # -- API for the driver ------------------------------------------------------------

    def assign(self, job_id: str, req: GenerationRequest) -> None:
        """Queue a request on this rank; it starts when the pipeline thread is free."""
        self.runner.validate(req)  # a bad request fails here, at the caller, not mid-tick
        plan = self.runner.adapter.expert_plan(req) if self.experts > 1 else ()
        with self._cv:
            if self._closed:
                raise RuntimeError(f"rank {self.rank} is closed")
            if self._failed:
                raise RuntimeError(f"rank {self.rank} is out of service: {self._failed}")
            self._inbox.append(Job(job_id, req, plan))
            self._cv.notify_all()

    def cancel(self, job_id: str) -> bool:
        """Stop ``job_id``: dropped if queued, stopped at its next forward if running, at its
        next decoded chunk if decoding, its encode dropped if encoding (its FINISHED event says
        ``cancelled``). False if this rank does not hold it or its MP4 is done."""
        with self._cv:
            for job in self._inbox:
                if job.id == job_id:
                    self._inbox.remove(job)
                    self._emit(Event(EventKind.FINISHED, rank=self.rank, job_id=job_id, cancelled=True,
                                     error="cancelled"))
                    return True
            if job_id in self._live:  # at its next forward (a batch member: it leaves the batch) or chunk
                self._cancel.add(job_id)
                self._cv.notify_all()
                return True
            tail = self._encoding.get(job_id)
        return tail is not None and tail.cancel()

    def events(self, timeout: float = 1.0) -> list[Event]:
        """Everything that happened since the last call; waits up to ``timeout`` for one."""
        with self._cv:
            if not self._events:
                self._cv.wait_for(lambda: bool(self._events) or self._closed, timeout=timeout)
            out, self._events = self._events, []
            return out

    def status(self) -> dict[str, Any]:
        with self._cv:
            return {
                "rank": self.rank,
                "phase": self._phase.value,
                "current": self._current.id if self._current else None,
                "batch": list(self._members),
                "inbox": [j.id for j in self._inbox],
                "ticks": self.ticks,
                "forwards": self.forwards,
                "idle_ticks": self.idle_ticks,
                "null_ticks": self.null_ticks,
                "held_ticks": self.held_ticks,
                "agree_s": self.agree_s,
                "encoding": self.encoder.inflight,
                "states": self.tap.taken,
                "state_s": self.tap.take_s,
                "failed": self._failed,
            }

    def serve(self) -> dict[str, Any]:
        """Tick with the group until no rank has a forward to run or about to run.

        Every rank of the group calls this at the same time (the driver starts them
        together); all return together, after the same ticks.
        """
        self._bind_device()
        t0 = time.monotonic()
        ticks0 = self.ticks
        while True:
            if self.on_report is not None and time.monotonic() - self._reported > self.report_every_s:
                self._report()
            at_gate, busy = self._local_flags()
            tick = self._agree_experts(at_gate, busy) if self.experts > 1 else None
            any_gate, any_busy, all_gate = self._agree(at_gate, busy) if tick is None else \
                (tick.any_gate, tick.any_busy, tick.all_gate)
            if self.sequence_parallel and any_gate and not all_gate:
                any_gate = False  # SP: all ranks run a forward together, or none does
            if any_gate and tick is not None:
                self.runner.expect(tick.upcoming)  # before the forward: its last block prefetches it
                if at_gate and self._gate_expert != tick.expert:
                    at_gate = False  # held: another expert's tick; the forward waits at the gate
                    self.held_ticks += 1
            if any_gate:
                self.ticks += 1
                if at_gate:
                    self.tick_log.append(self._current.id if self._current else "?")
                    self._open_gate()
                elif tick is not None:
                    self.tick_log.append("")
                    self.idle_ticks += 1
                    self.runner.idle_forwards(1, tick.expert)
                else:
                    self.tick_log.append("")
                    self.idle_ticks += 1
                    self.runner.idle_forwards(1)
            elif any_busy:
                self.null_ticks += 1
                with self._cv:  # someone is still encoding text: ask again shortly
                    self._cv.wait(timeout=0.005)
            else:
                if self.on_report is not None:
                    self._report()
                return {"rank": self.rank, "ticks": self.ticks - ticks0,
                        "seconds": time.monotonic() - t0}

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5)
        for t in self._member_threads:
            t.join(timeout=5)
        for h in self._hooks:
            h.remove()
        self.tap.close()
        if self.previewer is not None:
            self.previewer.close()
            self.runner.adapter.latents_hook = None
        self.encoder.close()

    # -- the tick thread ---------------------------------------------------------------

    def _local_flags(self) -> tuple[bool, bool]:
        with self._cv:
            # A forward that just ran, or the scheduler step after it, decides what this
            # rank has next: wait for it rather than idling through a tick it could use.
            self._cv.wait_for(lambda: self._phase not in (Phase.FORWARD, Phase.BETWEEN) and not self._abort)
            if self._phase is Phase.HEAD or (self._phase is Phase.IDLE and self._inbox):
                # Text encoding takes milliseconds next to a forward: worth a short wait.
                self._cv.wait_for(lambda: self._phase in (Phase.GATE, Phase.TAIL)
                                  or (self._phase is Phase.IDLE and not self._inbox),
                                  timeout=self.head_wait_s)
            gate = self._gate_ids or ([self._current.id] if self._current is not None else [])
            if self._phase is Phase.GATE and gate and all(i in self._cancel for i in gate):
                self._abort = True  # the pipeline thread leaves the gate; this rank idles the tick
                self._cv.notify_all()
                self._cv.wait_for(lambda: not self._abort)
            at_gate = self._phase is Phase.GATE
            busy = at_gate or self._phase is Phase.HEAD or bool(self._inbox)
            if self.experts > 1:
                self._needs = self._expert_needs(at_gate)
            return at_gate, busy

    def _expert_needs(self, at_gate: bool) -> tuple[int, int, int]:
        """What this rank needs, for the agreement (called with ``_cv`` held, beside the flags)."""
        job = self._current
        if self._phase is Phase.HEAD and job is not None and job.plan:
            starting = job.plan[0]
        elif self._phase is Phase.IDLE and self._inbox and self._inbox[0].plan:
            starting = self._inbox[0].plan[0]
        else:
            starting = NONE  # decoding (TAIL): not at the next tick
        return needs(self._gate_expert if at_gate and job is not None else NONE, job.plan if job else (),
                     self._done_forwards, starting)

    def _agree_experts(self, at_gate: bool, busy: bool) -> Tick:
        """The per-tick agreement with two experts, in one SUM all-reduce (engine.experts)."""
        t0 = time.perf_counter()
        tick = agree(self.experts, at_gate, busy, self._needs, self.control)
        self.agree_s += time.perf_counter() - t0
        return tick

    def _report(self) -> None:
        self._reported = time.monotonic()
        try:
            self.on_report()  # type: ignore[misc]
        except Exception:  # noqa: BLE001 - metrics never stop the group
            pass

    def _agree(self, at_gate: bool, busy: bool) -> tuple[bool, bool, bool]:
        """(anyone at the gate, anyone busy, everyone at the gate), in one all-reduce."""
        if self.control is None:
            return at_gate, busy, at_gate
        t0 = time.perf_counter()
        flags = torch.tensor([int(at_gate), int(busy), int(not at_gate)], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.control)
        self.agree_s += time.perf_counter() - t0
        return bool(flags[0]), bool(flags[1]), not bool(flags[2])

    def _open_gate(self) -> None:
        with self._cv:
            self._go = True
            self._cv.notify_all()
            self._cv.wait_for(lambda: not self._go)  # the pipeline thread took it

    # -- the pipeline thread -----------------------------------------------------------

    def _gate_enter(self, expert: int, module: torch.nn.Module, args: object) -> None:
        with self._cv:
            self._gate_expert = expert
            if self._done_forwards == 0 and "first_gate" not in self._marks:
                self._marks["first_gate"] = time.monotonic()
            self._phase = Phase.GATE
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._go or self._closed or self._abort)
            if self._closed:
                raise RuntimeError(f"rank {self.rank} closed during a request")
            if self._abort:
                self._abort = False
                self._stopped = True  # _gate_leave still runs (always_call): not a forward
                self._phase = Phase.BETWEEN  # until _run ends it; the tick thread waits for that
                self._cv.notify_all()
                raise JobCancelled
            self._go = False
            self._phase = Phase.FORWARD
            self._cv.notify_all()

    def _gate_leave(self, module: torch.nn.Module, args: object, output: object) -> None:
        with self._cv:
            if self._stopped:
                self._stopped = False
                return
            self.forwards += 1
            self._done_forwards += 1
            job = self._current
            if job is not None and self._done_forwards == self._expected:
                self._phase = Phase.TAIL
                self._marks["forwards_done"] = time.monotonic()
                self._emit(Event(EventKind.FORWARDS_DONE, rank=self.rank, job_id=job.id))
            else:
                self._phase = Phase.BETWEEN
            self._cv.notify_all()

    def _bind_device(self) -> None:
        """The current CUDA device is per thread: point this one at the rank's GPU."""
        if self._cuda_index is not None:
            torch.cuda.set_device(self._cuda_index)

    def _pipeline_loop(self) -> None:
        self._bind_device()
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._inbox) or self._closed)
                if self._closed:
                    return
                job = self._inbox.popleft()
                batched = self._cap(job.req) > 1
                if batched:
                    self._current, self._expected, self._marks = None, -1, {}  # counted per member
                    self._done_forwards = 0
                    self._start_member(job)
                else:
                    self._current = job
                    self._live.add(job.id)
                    self._done_forwards = 0
                    self._expected = self.runner.adapter.forwards(job.req)
                    self._phase = Phase.HEAD
                    self._marks = {"start": time.monotonic()}
                    self._emit(Event(EventKind.STARTED, rank=self.rank, job_id=job.id,
                                     not_resumable=self._not_resumable(job.req)))
            if batched:
                self._drive(job)
            else:
                self._run(job)

    def _not_resumable(self, req: GenerationRequest) -> str:
        """Why a rerun of ``req`` would start from step 0 (the lead rank says; "" where its
        state is kept, or the request is refused anyway)."""
        if not self.lead:
            return ""
        try:
            return self.runner.resume_blocker(req)
        except Exception:  # noqa: BLE001 - a request its validation refuses next: nothing to say here
            return ""

    def _run(self, job: Job, member: Member | None = None) -> None:
        steps: list[float] = []
        own = member.marks if member is not None else self._marks  # the single path: set by the gate hooks

        def on_step(step: int, total: int) -> None:
            now = time.monotonic()
            steps.append(now - own.get("last_step", own.get("first_gate", now)))
            own["last_step"] = now  # the last one ends denoising (its scheduler step too)
            self._emit_locked(Event(EventKind.STEP, rank=self.rank, job_id=job.id, step=step, total=total))

        def on_latents(step: int, total: int, latents: torch.Tensor, loop: dict[str, Any]) -> None:
            # A STEP of its own, carrying the state (on a GPU it follows once the copy landed).
            self.tap.take(step, total, latents, loop, lambda st: self._emit_locked(
                Event(EventKind.STEP, rank=self.rank, job_id=job.id, step=st.step, total=st.total, state=st)))

        marks: dict[str, float] = {}
        timings: dict[str, float] = {}
        tail = Handoff(self.encoder, job.req.fps, lambda mp4, err, stop: self._finish(
            job, mp4, err, stop, marks, timings, steps)) if self.lead else None  # SP: the lead alone encodes
        error: str | None = None
        cancelled = False
        try:
            self.runner.frames(job.req, on_step, on_latents if self.lead else None,
                               partial(self._decoded, job, tail) if tail is not None else None,
                               denoiser=member.denoiser if member is not None else None)
        except JobCancelled:
            error, cancelled = "cancelled", True
        except Exception as e:  # noqa: BLE001 - the request fails with the reason; the rank lives
            error = f"{type(e).__name__}: {e}"
            if sticky_error(e):
                self._failed = error
        if self.previewer is not None:
            self.previewer.drain()  # its last preview before its end (TAIL: off the tick path)
        marks.update(own)
        marks["frames"] = time.monotonic()
        with self._cv:
            if error is None and job.id in self._cancel:  # cancelled after its last chunk
                error, cancelled = "cancelled", True
            self._cancel.discard(job.id)
            self._live.discard(job.id)
            if tail is not None:
                self._encoding[job.id] = tail  # cancel() finds it there until it finishes
            if member is not None:
                self._left(member, marks)
            else:
                self._current = None
                if self._phase is not Phase.TAIL:  # failed or cancelled before its last forward
                    marks.setdefault("forwards_done", marks["frames"])
                    self._emit(Event(EventKind.FORWARDS_DONE, rank=self.rank, job_id=job.id))
                self._phase = Phase.IDLE
            self._cv.notify_all()
        if self._failed:  # first: the group fails with this reason, for every job it holds
            self._emit_locked(Event(EventKind.RANK_FAILED, rank=self.rank, job_id=job.id, error=self._failed))
        timings.update(_stages(marks))
        if tail is None:
            self._finish(job, None, error, cancelled, marks, timings, steps)
        else:
            tail.end(error, cancelled)  # the encoder goes on; this thread takes the next request

    def _decoded(self, job: Job, tail: Handoff, frames: np.ndarray) -> None:
        """Each chunk the VAE decodes (pipeline thread): to the encoder, unless cancelled."""
        with self._cv:
            if job.id in self._cancel:
                raise JobCancelled
        tail.add(frames)

    def _finish(self, job: Job, mp4: bytes | None, error: str | None, cancelled: bool,
                marks: dict[str, float], timings: dict[str, float], steps: list[float]) -> None:
        now = time.monotonic()
        if mp4 is not None:
            timings = {**timings, "encode_s": now - marks["frames"]}
        with self._cv:
            self._encoding.pop(job.id, None)
            self._emit(Event(EventKind.FINISHED, rank=self.rank, job_id=job.id, mp4=mp4, error=error,
                             cancelled=cancelled, seconds=now - marks["start"], timings=timings,
                             step_s=tuple(steps)))

    def _on_latents(self, step: int, total: int, latents: torch.Tensor) -> None:
        """The adapter's latents at a step's end (pipeline thread): the previewer takes them."""
        job = getattr(self._local, "job", None) or self._current  # a batch member's own thread
        if job is not None and self.previewer is not None:
            self.previewer.take(job.id, step, total, latents, job.req.height, job.req.width)

    def _emit(self, event: Event) -> None:
        """Append an event; the caller holds ``_cv``."""
        self._events.append(event)
        self._cv.notify_all()

    def _emit_locked(self, event: Event) -> None:
        with self._cv:
            self._emit(event)


def _stages(marks: dict[str, float]) -> dict[str, float]:
    """Seconds per stage on the rank, from the marks the pipeline thread set (they tile the
    time from taking the job to its frames: text encoding up to the first forward's gate,
    denoising up to the end of the last step, then the VAE decode); ``batch_size``, not a time:
    the most requests that shared one of its forwards (1 unbatched)."""
    start, frames = marks["start"], marks["frames"]
    done = min(frames, max(marks.get("forwards_done", frames), marks.get("last_step", 0.0)))
    gate = min(marks.get("first_gate", done), done)
    return {"text_encode_s": gate - start, "denoise_s": done - gate, "decode_s": frames - done,
            "batch_size": marks.get("batch_size", 1)}
