"""Where the time from ``dloserve serve`` to ready went: ``/readyz``'s ``startup``.

The steps run one after another, so their seconds add up to ``ready_s`` (from the start of
the ``dloserve serve`` process, as a user's stopwatch has it, to the last group's first
ready); ``unaccounted_s`` is what no step covers (it should stay near 0). The launcher
stamps its own steps (``Launched.marks``, wall-clock); the replica stamps when it began;
the executor when it began, its placement and auto probe, and when each group was first
ready (each group's own breakdown is ``groups[].last_start``: actor start, rendezvous,
load). A replica that Serve started from a config file has no launcher marks: its
breakdown starts at the replica. ``parallel.model_check_s``: the launcher's check of the
model (config files and checkpoint headers: no torch), on a thread beside its other checks,
Ray's start and Serve's.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Launched:
    """What the ``dloserve serve`` launcher did before Serve started the replica (not settings:
    a Serve config file has none of it). ``marks``: when its steps ended, wall-clock."""

    marks: dict[str, float] = field(default_factory=dict)


def process_started_at(pid: int | None = None) -> float | None:
    """When the process (this one by default) started, wall-clock (the kernel's 10 ms ticks):
    the breakdown starts where a user's stopwatch does, before the interpreter's start and the
    CLI's imports. None where that cannot be told. (psutil's own start time counts from the
    boot time in whole seconds: the seconds since boot are taken from it, the boot from the
    clock.)"""
    import psutil

    try:
        since_boot = psutil.Process(os.getpid() if pid is None else pid).create_time() - psutil.boot_time()
    except psutil.Error:
        return None
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + since_boot


def startup_breakdown(marks: dict[str, float], replica_at: float, engine: dict[str, Any],
                      groups: int) -> dict[str, Any]:
    """``marks``: the launcher's ``process`` (this process's start), ``command`` (its first
    stamp), ``model_checked``, ``checked`` (model, keys, results folder, port), ``ray_up`` and
    ``serve_up`` (Serve's controller and proxies up; without it one step to the replica);
    ``engine``: the executor's ``startup`` status; ``groups``: how many."""
    ready = engine.get("groups_ready_at") or {}
    began = engine.get("began_at")
    t_ready = max(ready.values()) if ready and len(ready) >= groups else None
    steps: dict[str, float | None] = {}
    if marks:
        if marks.get("process"):  # the interpreter's start, the CLI's imports, its flags
            steps["process_start_s"] = _between(marks["process"], marks.get("command"))
        steps["launcher_checks_s"] = _between(marks.get("command"), marks.get("checked"))
        steps["ray_start_s"] = _between(marks.get("checked"), marks.get("ray_up"))
        if marks.get("serve_up"):  # Serve's controller and proxies; the replica's process and imports
            steps["serve_start_s"] = _between(marks.get("ray_up"), marks["serve_up"])
            steps["replica_start_s"] = _between(marks["serve_up"], replica_at)
        else:
            steps["serve_and_replica_start_s"] = _between(marks.get("ray_up"), replica_at)
    steps["replica_init_s"] = _between(replica_at, began)  # model card, job store, dispatcher
    steps["engine.placement_s"] = engine.get("placement_s")
    if "auto_probe_s" in engine:
        steps["engine.auto_probe_s"] = engine["auto_probe_s"]
    groups_began = None if began is None else began + sum(
        engine.get(k) or 0.0 for k in ("placement_s", "auto_probe_s"))
    steps["groups_s"] = _between(groups_began, t_ready)  # the groups start at once; the last one
    start = (marks.get("process") or marks.get("command", replica_at)) if marks else replica_at
    total = _between(start, t_ready)
    known = [v for v in steps.values() if v is not None]
    parallel: dict[str, Any] = {}
    if marks.get("model_checked") and marks.get("command"):  # the model's check, beside the launcher's steps
        parallel["model_check_s"] = {"began_s": _between(start, marks["command"]),
                                     "s": _between(marks["command"], marks["model_checked"]),
                                     "beside": ["launcher_checks_s", "ray_start_s", "serve_start_s"]}
    began_from = ("process" if marks.get("process") else "command") if marks else "replica"
    return {"from": began_from, "ready_s": total, "steps": steps,
            "unaccounted_s": None if total is None else round(total - sum(known), 3), "parallel": parallel}


def _between(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 3)


def bytecode_facts() -> dict[str, Any]:
    """Whether this Python keeps compiled bytecode and whether torch's is there (found, not
    imported): ``writes``, ``prefix`` (``PYTHONPYCACHEPREFIX``), ``torch_cached`` and
    ``torch_writable`` (whether an import could write it where it is looked for)."""
    out: dict[str, Any] = {"writes": not sys.dont_write_bytecode, "prefix": sys.pycache_prefix}
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.origin:
        cached = Path(importlib.util.cache_from_source(spec.origin))
        folder = next(p for p in cached.parents if p.exists() or p == p.parent)
        out["torch_cached"] = cached.is_file()
        out["torch_writable"] = os.access(folder, os.W_OK)
    return out


def uncompiled_imports() -> str | None:
    """Why every process a start makes here (Serve's, the replica's, each rank's) would compile
    its imports from source, or None: torch has no compiled bytecode beside it (installed with
    ``pip --no-compile``, or by uv without ``UV_COMPILE_BYTECODE=1``) and none will be kept. On a
    2-core CPU that made ``import torch, diffusers.utils`` 5.6 s against 1.8 s."""
    facts = bytecode_facts()
    if facts.get("torch_cached", True) or (facts["writes"] and facts["torch_writable"]):
        return None
    why = "PYTHONDONTWRITEBYTECODE is set" if not facts["writes"] else "its folder is read-only"
    return (f"torch's modules have no compiled bytecode on this node and none will be kept ({why}): "
            "every process this start makes (Serve's, the replica's, each rank's) compiles its imports "
            "from source, about 3x their time; compile them once (`python -m compileall -q` over the "
            "site-packages, or install with pip's default or UV_COMPILE_BYTECODE=1)")
