"""``dloserve generate``: one request through the same dispatcher the service uses, on local
ranks (``engine.local``), its MP4 written to a file."""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from typing import Any

from service.config import EngineConfig
from service.router.build import build_dispatcher
from service.router.policy import DeadlinePolicy


def generate(config: EngineConfig, req: Any, out: str, *, progress: bool = False) -> str:
    """``dloserve generate``: one request through the same dispatcher the service uses, on
    local ranks (``config.parallel.executor`` local), its MP4 written to ``out`` atomically;
    RuntimeError with the reason if it fails. With DP N the request runs on one rank (in an
    AllGather group the others replay its gathers); with SP S one SP group of S processes runs
    it. Returns the mode it ran in (auto's choice and why, when auto chose)."""
    config = replace(config, parallel=replace(config.parallel, executor="local", encoders_per_rank=0,
                                              pg_timeout_s=600.0),
                     scheduler=replace(config.scheduler, max_queue_wait_s=float("inf")))
    sink = _OneFile(req.num_inference_steps if progress else 0)
    dispatcher = build_dispatcher(config, sink, max_attempts=1, progress=progress, deadlines=_no_deadline())
    dispatcher.start()
    try:
        dispatcher.submit("request", req.compat_key(), req)
        outcome = sink.wait()
    finally:
        dispatcher.stop()
    if not outcome.ok:
        raise RuntimeError(outcome.error or "generation failed")
    _write(out, outcome.mp4)
    choice = dispatcher.choice
    return f"auto: {choice.mode.value} ({choice.reason})" if choice else config.offload.mode.value


def _no_deadline() -> DeadlinePolicy:
    """``generate`` waits as long as the request takes (a human is watching the bar)."""
    return DeadlinePolicy(base_s=float("inf"))


class _OneFile:
    """The sink of ``generate``: a step bar, and the one outcome."""

    def __init__(self, steps: int) -> None:
        self._done = threading.Event()
        self.outcome: Any = None
        self.bar: Any = None
        if steps:
            from tqdm import tqdm

            self.bar = tqdm(total=steps, desc="denoising", unit="step")

    def on_start(self, ticket: Any, info: dict[str, Any]) -> None:
        pass

    def on_progress(self, ticket_id: str, step: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def on_requeue(self, ticket: Any, why: str) -> None:
        if self.bar is not None:
            self.bar.write(f"its rank died under it ({why}); running it again")
            self.bar.reset()

    def on_finish(self, ticket: Any, outcome: Any, info: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.close()
        self.outcome = outcome
        self._done.set()

    def wait(self) -> Any:
        self._done.wait()
        return self.outcome


def _write(path: str, data: bytes) -> None:
    """Write atomically: a reader never sees half a file."""
    import tempfile
    from pathlib import Path

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
