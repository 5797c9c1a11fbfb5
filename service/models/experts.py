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


def mixed_share(plan: Sequence[int]) -> float:
    """Chance that two ranks at independent, uniform points of this plan need different
    experts: 2 h (1 - h) for a share h of high-noise forwards (0 with one expert)."""
    if not plan:
        return 0.0
    h = plan.count(0) / len(plan)
    return 2 * h * (1 - h)


def expert_of(module: nn.Module) -> list[nn.Module]:
    """The modules that each make one transformer forward: the experts, or the module itself."""
    return [module.expert(i) for i in range(len(module.names))] if isinstance(module, Experts) else [module]
