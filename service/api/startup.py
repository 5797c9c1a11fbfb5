"""Where the time from ``dloserve serve`` to ready went: ``/readyz``'s ``startup``.

The steps run one after another, so their seconds add up to ``ready_s`` (from the start of
the ``dloserve serve`` process, as a user's stopwatch has it, to the last group's first
ready); ``unaccounted_s`` is what no step covers (it should stay near 0).
The launcher stamps its own steps (``Launched.marks``, wall-clock); the replica
stamps when it began; the executor when it began, its placement and auto probe, and when
each group was first ready (each group's own breakdown is ``groups[].last_start``: actor
start and imports, rendezvous, load). A replica that Serve started from a config file has
no launcher marks: its breakdown starts at the replica.

``parallel``: what ran beside the steps, not in their sum: ``model_check_s``, the launcher's
check of the model (torch's import first) on a thread while it checks the rest and starts
Ray (a wait for it after Ray is up counts in ``ray_start_s``); ``rank_processes_s``, the rank
processes the launcher started (``--rank-prestart``: warm hosts before Ray, engine.warmhost,
else actors right after it), from then until the last of them had imported, and when that
began (``began_s``, from the process's start); the steps
it overlaps are named. If they were still importing when the executor adopted them, that
wait is the groups' ``actors_s``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Launched:
    """What the ``dloserve serve`` launcher did before Serve started the replica: not settings
    (a Serve config file has none of it), handed to the replica beside its ServiceConfig.
    ``marks``: when the launcher's steps ended, wall-clock (``startup_breakdown``);
    ``prestarted``: the rank processes it started, by bundle (the first groups adopt them);
    ``ingress_executable``: the replica's worker command, a warm host's shim (engine.warmhost)."""

    marks: dict[str, float] = field(default_factory=dict)
    prestarted: list[str] = field(default_factory=list)
    ingress_executable: str | None = None


def process_started_at(pid: int | None = None) -> float | None:
    """When the process (this one by default) started, wall-clock, from its ``starttime`` in
    /proc (10 ms resolution): the breakdown starts where a user's stopwatch does, before the
    interpreter's start and the CLI's imports. None where /proc cannot tell."""
    from service.api.watchdog import start_time

    ticks = start_time(os.getpid() if pid is None else pid)
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return None if ticks is None else time.time() - (uptime - int(ticks) / os.sysconf("SC_CLK_TCK"))


def startup_breakdown(marks: dict[str, float], replica_at: float, engine: dict[str, Any],
                      groups: int, replica_host: dict[str, float] | None = None) -> dict[str, Any]:
    """``marks``: the launcher's ``process`` (this process's start), ``command`` (its first
    stamp), ``checked`` (model, keys, results folder, port), ``ray_up`` and ``serve_up``
    (Serve's controller up: its HTTP proxies start beside the replica; without it one
    step to the replica); ``engine``: the executor's ``startup`` status; ``groups``: how many;
    ``replica_host``: this replica's warm-host facts (engine.warmhost.hosted), if it ran in one."""
    ready = engine.get("groups_ready_at") or {}
    began = engine.get("began_at")
    t_ready = max(ready.values()) if ready and len(ready) >= groups else None
    steps: dict[str, float | None] = {}
    if marks:
        if marks.get("process"):  # the interpreter's start, the CLI's imports, its flags
            steps["process_start_s"] = _between(marks["process"], marks.get("command"))
        steps["launcher_checks_s"] = _between(marks.get("command"), marks.get("checked"))
        steps["ray_start_s"] = _between(marks.get("checked"), marks.get("ray_up"))
        if marks.get("serve_up"):  # Serve's controller; the replica's process and imports
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
    imported = engine.get("prestart_imported_at")
    if marks.get("ray_up") and imported:
        after_ray = [k for k in ("serve_start_s", "replica_start_s", "serve_and_replica_start_s")
                     if k in steps]
        began = marks.get("rank_hosts") or marks["ray_up"]  # warm hosts start before Ray
        before = ["launcher_checks_s", "ray_start_s"] if marks.get("rank_hosts") else []
        parallel["rank_processes_s"] = {"began_s": _between(start, began), "s": _between(began, imported),
                                        "beside": [*before, *after_ray, "replica_init_s", "groups_s"]}
    if marks.get("model_checked") and marks.get("command"):  # torch's import and the model's check
        parallel["model_check_s"] = {"began_s": _between(start, marks["command"]),
                                     "s": _between(marks["command"], marks["model_checked"]),
                                     "beside": ["launcher_checks_s", "ray_start_s"]}
    if replica_host and marks.get("ray_up"):  # the replica's imports, done in its warm host
        parallel["replica_imports_s"] = {"began_s": _between(start, replica_host["started"]),
                                         "s": round(replica_host["import_s"], 3),
                                         "beside": ["launcher_checks_s", "ray_start_s"]}
    began_from = ("process" if marks.get("process") else "command") if marks else "replica"
    return {"from": began_from, "ready_s": total, "steps": steps, "replica_hosted": bool(replica_host),
            "unaccounted_s": None if total is None else round(total - sum(known), 3), "parallel": parallel}


def _between(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 3)
