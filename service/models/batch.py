"""Several requests' transformer calls as one forward: each block streamed once for all.

Each request of a batch runs diffusers' own pipeline in a thread of its own, with its own
seed, scheduler and step count (wan.py, untouched). Its denoiser is a ``Joined``: a call
puts the keyword inputs on the ``Board`` and waits. The rank's driver (engine/rank.py) picks
the calls waiting, ``Board.run`` concatenates them along the batch (latents, timesteps,
text rows: every tensor input's first dimension), runs the real transformer once and hands
each request its own rows back. One call alone is passed through unchanged, so a request
that runs alone gives exactly the bytes of an unbatched run.

A batched forward is not bitwise the forwards of its rows one by one (a GEMM's kernel may
change with its row count): a batched request's frames depend on which requests shared its
forwards (deterministic for that composition, docs/service.md gives the measured PSNR).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


class Board:
    """Where the members' calls wait for the driver's forward. ``cv`` is shared with the
    driver (the rank's condition), so its waits see the calls arrive."""

    def __init__(self, cv: threading.Condition) -> None:
        self.cv = cv
        # Held by a member's thread while it runs its pipeline, released while it waits here:
        # the members' host work takes turns. diffusers' Wan VAE keeps its causal feature cache
        # on the shared module and a fast tokenizer refuses concurrent use.
        self.solo = threading.Lock()
        self.pending: dict[str, dict[str, Any]] = {}  # member -> the inputs of its waiting call
        self._results: dict[str, Any] = {}  # member -> its rows of the output, or an exception

    def call(self, member: str, kwargs: dict[str, Any]) -> Any:
        """A member's denoiser call (its thread): wait for the forward that includes it."""
        with self.cv:
            self.pending[member] = kwargs
            self.cv.notify_all()
        self.solo.release()
        try:
            with self.cv:
                self.cv.wait_for(lambda: member in self._results)
                out = self._results.pop(member)
        finally:
            self.solo.acquire()
        if isinstance(out, BaseException):
            raise out
        return out

    def take(self, members: list[str]) -> list[dict[str, Any]]:
        """The waiting calls of ``members`` (the caller holds ``cv``), off the board."""
        return [self.pending.pop(m) for m in members]

    def answer(self, members: list[str], outputs: list[Any] | BaseException) -> None:
        """Each member's output (or one exception for all of them); wakes them."""
        with self.cv:
            for i, m in enumerate(members):
                self._results[m] = outputs if isinstance(outputs, BaseException) else outputs[i]
            self.cv.notify_all()

    def run(self, module: nn.Module, members: list[str], calls: list[dict[str, Any]]) -> None:
        """One forward of ``module`` over ``calls`` (the driver's thread); every member gets
        its rows, or the forward's exception, which is raised here too."""
        try:
            rows = [_rows(c) for c in calls]
            with torch.no_grad():  # the members' pipelines run under no_grad: a mode of their threads
                out = module(**calls[0]) if len(calls) == 1 else module(**merge(calls))
            outputs = [out] if len(calls) == 1 else split(out, rows)
        except BaseException as e:
            self.answer(members, e)
            raise
        self.answer(members, outputs)


class Joined:
    """One member's denoiser: every attribute is the module's (config, dtype, hooks), the
    call goes through the board. ``cache_context`` is not passed on: batched requests have
    no step cache (engine/batching.py), and the members' branches would interleave on the
    shared module."""

    def __init__(self, module: nn.Module, board: Board, member: str) -> None:
        self.__dict__.update(_module=module, _board=board, _member=member)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    @contextmanager
    def cache_context(self, name: str, **kwargs: Any) -> Iterator[None]:
        yield

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            raise TypeError("a batched denoiser takes the pipeline's keyword call only")
        return self._board.call(self._member, kwargs)


def _rows(kwargs: dict[str, Any]) -> int:
    x = kwargs.get("hidden_states")
    if not isinstance(x, torch.Tensor):
        raise RuntimeError("batch: a denoiser call without hidden_states")
    return int(x.shape[0])


def merge(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The calls' keyword inputs as one: tensors concatenated along dim 0 (a 0-d timestep is
    given one row per request), anything else must be equal."""
    keys = set(calls[0])
    if any(set(c) != keys for c in calls):
        raise RuntimeError("batch: the calls' inputs differ in their names")
    out: dict[str, Any] = {}
    for k in calls[0]:
        values = [c[k] for c in calls]
        if isinstance(values[0], torch.Tensor):
            parts = []
            for c, v in zip(calls, values, strict=True):
                parts.append(v.reshape(1).expand(_rows(c)) if v.ndim == 0 else v)
            if len({tuple(p.shape[1:]) for p in parts}) != 1:
                raise RuntimeError(f"batch: {k} has shapes {[tuple(p.shape) for p in parts]}")
            out[k] = torch.cat(parts, dim=0)
        elif values[0] is None or all(v == values[0] for v in values):
            out[k] = values[0]
        else:
            raise RuntimeError(f"batch: {k} differs between the calls")
    return out


def split(out: Any, rows: list[int]) -> list[Any]:
    """The forward's output (a tuple with return_dict=False, or a dataclass) -> per call."""
    if isinstance(out, tuple):
        per = [split(o, rows) for o in out]
        return [tuple(p[i] for p in per) for i in range(len(rows))]
    if isinstance(out, torch.Tensor):
        return list(torch.split(out, rows, dim=0))
    return [type(out)(sample=s) for s in torch.split(out.sample, rows, dim=0)]
