"""Two denoisers in one pipeline (Wan2.2 A14B): one module for the offload, a plan per request.

A Wan2.2 A14B pipeline has a high-noise expert (``transformer``) for the steps whose
timestep is at or above ``boundary_ratio x num_train_timesteps`` and a low-noise expert
(``transformer_2``) for the rest; diffusers' pipeline picks one per step. ``Experts`` holds
both as children named after their component folders, so the offload library sees one
module whose state-dict keys are ``transformer.*`` and ``transformer_2.*`` and one
checkpoint (a prefix -> folder mapping): one page-cache copy, one host arena, one ring, two
slots. ``expert_plan`` says which expert each of a request's forwards uses, from the same
scheduler timesteps the pipeline will compute, so a rank can tell its group what it needs
next and the ring can prefetch across the switch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn


class Experts(nn.Module):
    """The denoisers of one pipeline as named children (never called as a whole)."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        super().__init__()
        self.names = tuple(modules)
        for name, module in modules.items():
            self.add_module(name, module)

    def expert(self, index: int) -> nn.Module:
        return self.get_submodule(self.names[index])

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("Experts is not run as a whole: the pipeline calls one expert per step")


def expert_plan(scheduler: Any, steps: int, boundary_ratio: float | None, cfg: bool) -> tuple[int, ...]:
    """The expert of each transformer forward of a request: 0 (``transformer``) while the
    step's timestep is >= the boundary, else 1 (``transformer_2``); two forwards per step
    under CFG. ``scheduler`` is a fresh one (set_timesteps changes its state), as the
    pipeline's is."""
    per_step = 2 if cfg else 1
    if boundary_ratio is None:
        return (0,) * (steps * per_step)
    scheduler.set_timesteps(steps, device="cpu")
    boundary = boundary_ratio * scheduler.config.num_train_timesteps
    return tuple(0 if t >= boundary else 1 for t in scheduler.timesteps.tolist() for _ in range(per_step))


NONE = -1  # no expert needed
RULES = ("majority", "union", "later")


def choose(counts: Sequence[int]) -> int:
    """The expert most ranks need; ties go to the earlier expert; NONE when none is needed."""
    best = max(range(len(counts)), key=lambda e: (counts[e], -e))
    return best if counts[best] else NONE


def simulate(plans: Sequence[Sequence[int]], world: int, rule: str = "majority") -> dict[str, float]:
    """Forwards per tick of a group of ``world`` ranks running ``plans`` (requests, taken in
    order by whichever rank is free, continuous scheduling) under ``rule``: "majority" (what
    the group does), "union" (every needed expert in one tick: a forward's time per expert)
    or "later" (the later expert first). Counts only (no timing): docs/models.md, tests.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    queue = [list(p) for p in plans]
    running: list[list[int]] = [queue.pop(0) if queue else [] for _ in range(world)]
    cost = forwards = 0
    while any(running):
        needs = [r[0] for r in running if r]
        counts = [needs.count(e) for e in range(max(needs) + 1)]
        if rule == "union":
            runs = [e for e, c in enumerate(counts) if c]
        else:
            runs = [max(needs) if rule == "later" else choose(counts)]
        for e in runs:
            cost += 1  # one forward's time per expert run
            for i, r in enumerate(running):
                if r and r[0] == e:
                    r.pop(0)
                    forwards += 1
                    if not r and queue:
                        running[i] = queue.pop(0)
    return {"forward_times": cost, "forwards": forwards,
            "efficiency": forwards / (world * cost) if cost else 1.0}


def lockstep_expert_cost(plans: Sequence[Sequence[int]], world: int) -> float:
    """What two experts cost an AllGather group of ``world`` ranks running ``plans`` under the
    group's rule (``choose``), as a fraction of extra ticks: the simulated ticks against the
    same requests with one expert (which keeps the queue's tail, so only the experts count).
    0 at one rank or with one expert; auto mode charges AllGather this (offload.auto)."""
    if world <= 1 or not plans:
        return 0.0
    two = simulate(plans, world)["forward_times"]
    one = simulate([[0] * len(p) for p in plans], world)["forward_times"]
    return two / one - 1 if one else 0.0


def expert_of(module: nn.Module) -> list[nn.Module]:
    """The modules that each make one transformer forward: the experts, or the module itself."""
    return [module.expert(i) for i in range(len(module.names))] if isinstance(module, Experts) else [module]
