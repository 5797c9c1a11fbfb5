"""What a scheduler keeps between steps is all taken (models/loop.py), for every scheduler
the families use or may be given:

- every attribute ``step()`` changes or adds is in what is taken, step after step (a new
  scheduler, or a field a diffusers release adds, cannot be silently lost);
- a fresh scheduler given the taken state (through the state's bytes) goes on bit for bit
  like the one that ran;
- a scheduler holding an object of its own is said not resumable, with the attribute named.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import (
    DPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
    UniPCMultistepScheduler,
)

from service.models import loop
from service.models.resume import StepState

FLOW = dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
SCHEDULERS = {
    "unipc-wan": lambda: UniPCMultistepScheduler(**FLOW, num_train_timesteps=1000),  # Wan2.1/2.2's published
    "unipc-order3": lambda: UniPCMultistepScheduler(**FLOW, solver_order=3),
    "euler": lambda: FlowMatchEulerDiscreteScheduler(shift=3.0),
    "dpm++": lambda: DPMSolverMultistepScheduler(**FLOW),
}
STEPS = 6


def _snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, list | tuple):
        return type(value)(_snapshot(v) for v in value)
    return copy.copy(value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, list | tuple) or isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b if not isinstance(a, np.ndarray) else np.array_equal(a, b)


def _outputs(shape: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(shape, generator=g) for _ in range(STEPS)]


def _through_bytes(state: dict[str, Any]) -> dict[str, Any]:
    x = torch.zeros(1)
    tree = pickle.loads(pickle.dumps(StepState.of(1, 2, x, {"scheduler": state}))).loop_tree()
    return tree["scheduler"]


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_every_attribute_a_step_changes_is_taken(name: str) -> None:
    s = SCHEDULERS[name]()
    s.set_timesteps(STEPS)
    s.set_begin_index(0)
    x = torch.randn(1, 4, 2, 3, 3, generator=torch.Generator().manual_seed(0))
    changed_ever: set[str] = set()
    for t, out in zip(s.timesteps, _outputs(x.shape), strict=True):
        before = {k: _snapshot(v) for k, v in vars(s).items()}
        x = s.step(out, t, x, return_dict=False)[0]
        changed = {k for k, v in vars(s).items() if k not in before or not _same(before[k], v)}
        taken = loop.scheduler_state(s)
        assert changed <= set(taken), f"{name}: step() changed {sorted(changed - set(taken))}, not taken"
        changed_ever |= changed
    assert "_step_index" in changed_ever  # the diff sees what a step does
    if name.startswith(("unipc", "dpm")):
        assert {"model_outputs", "lower_order_nums"} <= changed_ever


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
@pytest.mark.parametrize("k", [1, 3])
def test_a_fresh_scheduler_given_the_state_goes_on_bitwise(name: str, k: int) -> None:
    ran, fresh = SCHEDULERS[name](), SCHEDULERS[name]()
    x = torch.randn(1, 4, 2, 3, 3, generator=torch.Generator().manual_seed(0))
    outputs = _outputs(x.shape)
    for s in (ran, fresh):
        s.set_timesteps(STEPS)
        s.set_begin_index(0)
    for i in range(k):
        x = ran.step(outputs[i], ran.timesteps[i], x, return_dict=False)[0]
    loop.restore_scheduler(fresh, _through_bytes(loop.scheduler_state(ran)))
    y = x.clone()
    for i in range(k, STEPS):
        x = ran.step(outputs[i], ran.timesteps[i], x, return_dict=False)[0]
        y = fresh.step(outputs[i], fresh.timesteps[i], y, return_dict=False)[0]
        assert torch.equal(x, y), f"{name}: step {i} after a restore at {k}"


def test_a_scheduler_holding_an_object_is_said_not_resumable() -> None:
    assert loop.scheduler_blocker(SCHEDULERS["unipc-wan"]()) == ""
    s = SCHEDULERS["unipc-wan"]()
    s.solver_p = FlowMatchEulerDiscreteScheduler()  # UniPC's optional predictor: a scheduler object
    why = loop.scheduler_blocker(s)
    assert "scheduler.solver_p" in why and "FlowMatchEulerDiscreteScheduler" in why
