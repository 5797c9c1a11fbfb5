"""What an accepted job needs to run again after a restart, as files beside its record.

``<id>.req``: its request, JSON (the image as base64, adapters as resolved, the step cache),
written by the job store when it accepts the job. ``<id>.state``: its last kept per-step
state (models/resume.py): one JSON header line (step, total, dtype, shape, and the loop's
state as JSON with its tensors' dtypes and shapes), the latents' raw bytes, then the loop
tensors' raw bytes, written by the replica that runs it at most every ``STATE_EVERY_S`` per job and
at once when it is paused for a better priority. Both are 0600 like every result file
(results.py), both go when the job ends or is deleted. A file that cannot be read back is
no file: the job reruns from step 0 (no state) or fails with a reason (no request).

Neither is pickle: a results bucket's contents are data, never code to run.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from typing import Any

import numpy as np

from service.config.cache import CacheSpec
from service.models.lora_ref import LoraRef
from service.models.request import GenerationRequest, RequestError
from service.models.resume import StepState

STATE_EVERY_S = 5.0  # a running job's state reaches the store at most this often (and at a pause)
MAX_STATE_BYTES = 1 << 30  # a header that claims more is not one of ours
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def request_bytes(req: GenerationRequest) -> bytes:
    d: dict[str, Any] = {f.name: getattr(req, f.name) for f in dataclasses.fields(req)
                         if f.name not in ("image", "loras", "cache", "resume")}
    d["image"] = None if req.image is None else base64.b64encode(req.image).decode()
    d["loras"] = [dataclasses.asdict(r) for r in req.loras]
    d["cache"] = None if req.cache is None else dataclasses.asdict(req.cache)
    return json.dumps({"version": 1, "request": d}, allow_nan=False).encode()


def request_of(data: bytes | None) -> GenerationRequest | None:
    """The request back, checked as on the rank; None where it cannot be read."""
    try:
        d = dict(json.loads(data or b"")["request"])
        if d.get("image") is not None:
            d["image"] = base64.b64decode(d["image"], validate=True)
        d["loras"] = tuple(LoraRef(**x) for x in d.get("loras") or [])
        if d.get("cache") is not None:
            d["cache"] = CacheSpec(**d["cache"])
        req = GenerationRequest(**d)
        req.check()
        return req
    except (ValueError, TypeError, KeyError, RequestError):
        return None


def state_bytes(state: StepState) -> bytes:
    head = {"step": state.step, "total": state.total, "dtype": state.dtype, "shape": list(state.shape),
            **state.loop_header()}
    return json.dumps(head).encode() + b"\n" + np.ascontiguousarray(state.data).tobytes() + state.loop_bytes()


def state_of(data: bytes | None, req: GenerationRequest) -> StepState | None:
    """The state back, if it is a whole one that ``req`` can go on from; None otherwise."""
    if not data:
        return None
    head_raw, sep, raw = data.partition(b"\n")
    try:
        head = json.loads(head_raw)
        step, total, dtype, shape = int(head["step"]), int(head["total"]), str(head["dtype"]), \
            tuple(int(x) for x in head["shape"])
    except (ValueError, TypeError, KeyError):
        return None
    size = DTYPE_BYTES.get(dtype, 0) * math.prod(shape)
    if not sep or not size or size > MAX_STATE_BYTES or len(raw) < size \
            or not 0 < step < total == req.num_inference_steps:
        return None  # torn, foreign, or not a step this request can go on from
    latents = StepState(step, total, dtype, shape, np.frombuffer(raw, dtype=np.uint8, count=size).copy())
    try:
        return latents.with_loop(head, raw[size:])
    except (ValueError, TypeError, KeyError):
        return None  # no loop state (a file of an older release), or not a whole one


class StateKeeper:
    """A replica's writer of its running jobs' states: ``offer`` from the dispatcher thread
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
                t0 = time.perf_counter()
                try:
                    self.storage.put_bytes(f"{job_id}.state", state_bytes(state))
                except OSError as e:
                    logging.getLogger("dloserve.api").warning("state of %s not kept: %s", job_id, e)
                    continue
                self.write_s += time.perf_counter() - t0
                self._last[job_id] = now
                self.written += 1
                n += 1
        return n
