"""What an accepted job needs to run again after a restart, as files beside its record.

``<id>.req``: its request, JSON (the image as base64, adapters as resolved, the step cache),
written by the job store when it accepts the job. ``<id>.state``: its last kept per-step
state (models/resume.py): one JSON header line (step, total, dtype, shape, whose: the job id
and its request's digest, and the loop's state as JSON with its tensors' dtypes and shapes),
the latents' raw bytes, then the loop tensors' raw bytes, written by the replica that runs
it at most every ``STATE_EVERY_S`` per job and at once when it is paused for a better
priority. Both are 0600 like every result file (results.py), both go when the job ends or is
deleted. They are read as data another process may have written: capped, never through a
link or from a FIFO (``ResultStorage.read_capped``), any parse error caught. A request that
cannot be used fails its one job with a reason naming the file; a state that is not its job's
and request's, or whose latents are not the shape and dtype the model makes for the request
(the replica checks that: ``usable_state``), is none: the job reruns from step 0.

Neither is pickle: a results bucket's contents are data, never code to run.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import math
from typing import Any

import numpy as np

from service.api.results import ResultStorage, UnusableFile
from service.config.cache import CacheSpec
from service.models.lora_ref import LoraRef
from service.models.request import GenerationRequest, RequestError
from service.models.resume import StepState

STATE_EVERY_S = 5.0  # a running job's state reaches the store at most this often (and at a pause)
MAX_STATE_BYTES = 1 << 30  # a header that claims more is not one of ours
MAX_LOOP_BYTES = 4 << 30  # the loop's tensors: UniPC's three latents more, a step cache's residuals
MAX_HEAD_BYTES = 64 << 10  # a state's JSON header line, the loop's tree included (UniPC's: ~1 kB)
MAX_REQUEST_BYTES = 256 << 20  # a request file: its image as base64 and the rest, a few KiB
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
FIELDS = {f.name for f in dataclasses.fields(GenerationRequest)} - {"resume"}
log = logging.getLogger("dloserve.durable")


def request_dict(req: GenerationRequest) -> dict[str, Any]:
    d: dict[str, Any] = {f.name: getattr(req, f.name) for f in dataclasses.fields(req)
                         if f.name not in ("image", "loras", "cache", "resume")}
    d["image"] = None if req.image is None else base64.b64encode(req.image).decode()
    d["loras"] = [dataclasses.asdict(r) for r in req.loras]
    d["cache"] = None if req.cache is None else dataclasses.asdict(req.cache)
    return d


def request_bytes(req: GenerationRequest) -> bytes:
    return json.dumps({"version": 1, "request": request_dict(req)}, allow_nan=False).encode()


def request_digest(req: GenerationRequest) -> str:
    """What ties a state to the request it was made for (every field but ``resume``, in a
    canonical order): a state of another request, or of the same one changed, is not its."""
    canon = json.dumps(request_dict(req), sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canon.encode()).hexdigest()


def request_from(data: bytes) -> GenerationRequest:
    """The request back, checked as on the rank; ValueError saying why it cannot be used
    (any failure of the parse or the checks, RecursionError of a deep nesting included)."""
    try:
        d = json.loads(data)["request"]
        if not isinstance(d, dict) or not set(d) <= FIELDS:
            raise ValueError(f"fields {sorted(set(d) - FIELDS) if isinstance(d, dict) else d!r} are no "
                             "request's")
        d = dict(d)
        if d.get("image") is not None:
            d["image"] = base64.b64decode(d["image"], validate=True)
        d["loras"] = tuple(LoraRef(**x) for x in d.get("loras") or [])
        if d.get("cache") is not None:
            d["cache"] = CacheSpec(**d["cache"])
        req = GenerationRequest(**d)
        req.check()
        return req
    except RequestError as e:
        raise ValueError(f"{e.field}: {e.message}") from None
    except Exception as e:  # noqa: BLE001 - whatever the bytes make the parser do, it is this file's
        raise ValueError(f"{type(e).__name__}: {str(e)[:200]}") from None


def request_of(data: bytes | None) -> GenerationRequest | None:
    """The request back, checked as on the rank; None where it cannot be read."""
    try:
        return request_from(data or b"")
    except ValueError:
        return None


def read_request(storage: ResultStorage, job_id: str) -> GenerationRequest | None:
    """``<job_id>.req`` back (None: there is none); ValueError naming the file and why it
    cannot be used."""
    name = f"{job_id}.req"
    try:
        data = storage.read_capped(name, MAX_REQUEST_BYTES)
        return None if data is None else request_from(data)
    except UnusableFile as e:
        raise ValueError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - the parse's error or the storage's: this file's
        raise ValueError(f"{storage.root}/{name}: {str(e)[:200] or type(e).__name__}") from None


def state_bytes(state: StepState, job_id: str = "", digest: str = "") -> bytes:
    """The header line (step, total, dtype, shape, whose: the job id and its request's digest,
    and the loop's tree), the latents' bytes, then the loop's tensors'."""
    head = {"step": state.step, "total": state.total, "dtype": state.dtype, "shape": list(state.shape),
            "job": job_id, "request": digest, **state.loop_header()}
    return json.dumps(head).encode() + b"\n" + np.ascontiguousarray(state.data).tobytes() + state.loop_bytes()


def state_problem(data: bytes | None, req: GenerationRequest, job_id: str) -> StepState | str:
    """The state back, if it is a whole one of this job and request that ``req`` can go on
    from; else why not (never raises: a state is a head start, and a bad one is none)."""
    if not data:
        return "no state"
    head_raw, sep, raw = data.partition(b"\n")
    try:
        if len(head_raw) > MAX_HEAD_BYTES:
            return "its header is too long"
        head = json.loads(head_raw)
        step, total, dtype, shape = int(head["step"]), int(head["total"]), str(head["dtype"]), \
            tuple(int(x) for x in head["shape"])
        job, digest = head.get("job"), head.get("request")
    except Exception as e:  # noqa: BLE001 - RecursionError and the like: not one of ours
        return f"its header cannot be read ({type(e).__name__})"
    if job != job_id or digest != request_digest(req):
        return "it is another job's or another request's"
    if not shape or any(n <= 0 for n in shape) or dtype not in DTYPE_BYTES:
        return f"shape {list(shape)} / dtype {dtype} is no latents'"
    size = DTYPE_BYTES[dtype] * math.prod(shape)
    if not sep or size > MAX_STATE_BYTES or len(raw) < size or len(raw) - size > MAX_LOOP_BYTES:
        return "it is torn or oversize"
    if not 0 < step < total == req.num_inference_steps:
        return f"step {step} of {total} is not a step to go on from for {req.num_inference_steps} steps"
    latents = StepState(step, total, dtype, shape, np.frombuffer(raw, dtype=np.uint8, count=size).copy())
    try:
        return latents.with_loop(head, raw[size:])
    except Exception as e:  # noqa: BLE001 - no loop state (an older release's file), or not a whole one
        return f"its loop state cannot be used ({type(e).__name__}: {str(e)[:100]})"


def state_of(data: bytes | None, req: GenerationRequest, job_id: str = "") -> StepState | None:
    """The state back, if it is a whole one of ``job_id`` and ``req`` that ``req`` can go on
    from; None otherwise."""
    got = state_problem(data, req, job_id)
    return got if isinstance(got, StepState) else None


def read_state(storage: ResultStorage, job_id: str, req: GenerationRequest) -> StepState | None:
    """``<job_id>.state`` if this job can go on from it; None (logged, naming the file: the
    job reruns from step 0) for anything else."""
    name = f"{job_id}.state"
    try:
        cap = MAX_STATE_BYTES + MAX_LOOP_BYTES + MAX_HEAD_BYTES + 1
        got = state_problem(storage.read_capped(name, cap), req, job_id)
    except Exception as e:  # noqa: BLE001 - a link, a FIFO, oversize, a storage error
        got = str(e)[:200] or type(e).__name__
    if isinstance(got, StepState):
        return got
    if got != "no state":
        log.warning("state %s/%s not used, %s reruns from step 0: %s", storage.root, name, job_id, got)
    return None


def usable_state(state: StepState, expected: tuple[tuple[int, ...], str] | None) -> bool:
    """Whether a state read back has the latents' ``(shape, dtype)`` the model makes for its
    request (None: the model makes no state to go on from)."""
    return expected is not None and (tuple(state.shape), state.dtype) == (tuple(expected[0]), expected[1])


class StateKeeper:
    """A replica's writer of its running jobs' states: ``track`` when it takes a job (the
    job's request digest goes in each state's header), ``offer`` from the dispatcher thread
    (keeps the latest, no I/O), ``write_due`` from the heartbeat thread (one file per job at
    most every ``every_s``, at once after ``urgent``), ``forget`` before a job's end is stored
    (no write of it lands after that: the lock covers the write)."""

    def __init__(self, storage: Any, every_s: float = STATE_EVERY_S) -> None:
        import threading

        self.storage = storage
        self.every_s = every_s
        self.written = 0  # files written (tests, /readyz-free bookkeeping)
        self.write_s = 0.0  # time spent writing them: the interval's cost
        self._lock = threading.Lock()
        self._latest: dict[str, StepState] = {}
        self._last: dict[str, float] = {}  # job -> when its state was last written (monotonic)
        self._urgent: set[str] = set()
        self._digests: dict[str, str] = {}  # job -> its request's digest (request_digest)

    def track(self, job_id: str, req: GenerationRequest) -> None:
        """This replica runs ``job_id`` for ``req``: its states are written as theirs."""
        digest = request_digest(req)
        with self._lock:
            self._digests[job_id] = digest

    def offer(self, job_id: str, state: StepState) -> None:
        with self._lock:
            self._latest[job_id] = state

    def urgent(self, job_id: str) -> None:
        """Write this job's latest state at the next beat (it was paused or queued again)."""
        with self._lock:
            self._urgent.add(job_id)

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._latest.pop(job_id, None)
            self._last.pop(job_id, None)
            self._urgent.discard(job_id)
            self._digests.pop(job_id, None)

    def write_due(self, now: float | None = None) -> int:
        """Write the states that are due; a failed write is logged and tried again later
        (the job goes on: a state is a head start, never the job)."""
        import logging
        import time

        now = time.monotonic() if now is None else now
        n = 0
        with self._lock:
            due = [j for j in self._latest
                   if j in self._urgent or now - self._last.get(j, -math.inf) >= self.every_s]
            for job_id in due:
                state = self._latest.pop(job_id)
                self._urgent.discard(job_id)
                digest = self._digests.get(job_id)
                if digest is None:  # not a job this replica took (create or adopt): whose would it be?
                    continue
                t0 = time.perf_counter()
                try:
                    self.storage.put_bytes(f"{job_id}.state", state_bytes(state, job_id, digest))
                except OSError as e:
                    logging.getLogger("dloserve.api").warning("state of %s not kept: %s", job_id, e)
                    continue
                self.write_s += time.perf_counter() - t0
                self._last[job_id] = now
                self.written += 1
                n += 1
        return n
