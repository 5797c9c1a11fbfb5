"""What a denoising loop keeps between steps, besides the latents: taken after a step, put back
before the next one of a rerun.

A rerun that goes on from step ``k`` needs every piece of state step ``k`` reads:

- the scheduler's: multistep solvers keep history (diffusers' ``UniPCMultistepScheduler``
  keeps its last model outputs, ``timestep_list``, ``last_sample`` for the corrector,
  ``lower_order_nums``, ``this_order``, the step index). It is found generically: every
  attribute of the scheduler object but its config (``__dict__``), so a scheduler nobody
  listed, or a field a diffusers release adds, is kept too (tests/models/test_loop.py diffs
  a scheduler's attributes across ``step()`` against what is taken);
- the step cache's (First Block Cache residuals, MagCache accumulators): the state objects
  of every stateful diffusers hook on the denoisers, per cache context ("cond", "uncond");
- the generator's, in case a scheduler draws from it after step 0.

The active expert of a two-expert model is not state: the pipeline picks it from the step's
timestep, which ``set_timesteps`` computes again. What is taken is a tree of plain values
and tensors (``Tree``); models/resume.py turns it into bytes. A value that is neither (an
object of its own) cannot be kept: ``Unkept`` says which, and the request reruns from step 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

Tree = dict[str, Any]  # str keys; values: None, bool, int, float, str, tensors, arrays, lists, tuples, dicts
SKIPPED = frozenset({"_internal_dict"})  # the scheduler's config: set again from the request


class Unkept(ValueError):
    """A piece of loop state that cannot be kept (its path and type in the message)."""


def check(value: Any, path: str) -> None:
    """Raise ``Unkept`` where ``value`` holds something other than plain values and tensors."""
    if value is None or isinstance(value, bool | int | float | str | torch.Tensor | np.ndarray):
        return
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            check(v, f"{path}[{i}]")
        return
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        for k, v in value.items():
            check(v, f"{path}.{k}")
        return
    raise Unkept(f"{path} is a {type(value).__name__}, which the step state cannot hold")


def scheduler_state(scheduler: Any) -> Tree:
    """Every attribute of ``scheduler`` but its config, as it is now (lists copied: schedulers
    shift them in place)."""
    out = {}
    for name, value in vars(scheduler).items():
        if name in SKIPPED:
            continue
        check(value, f"scheduler.{name}")
        out[name] = list(value) if isinstance(value, list) else value
    return out


def restore_scheduler(scheduler: Any, state: Tree) -> None:
    for name, value in state.items():
        setattr(scheduler, name, value)


def _stateful_hooks(denoisers: list[nn.Module]) -> Iterator[tuple[str, Any]]:
    """(path, state manager) of every stateful diffusers hook, each manager once (the head and
    tail hooks of a cache share one), in module order."""
    seen: set[int] = set()
    for d, module in enumerate(denoisers):
        for name, sub in module.named_modules():
            registry = getattr(sub, "_diffusers_hook", None)
            if registry is None:
                continue
            for hook_name, hook in registry.hooks.items():
                manager = getattr(hook, "state_manager", None)
                if manager is not None and id(manager) not in seen:
                    seen.add(id(manager))
                    yield f"{d}/{name}/{hook_name}", manager


def hook_states(denoisers: list[nn.Module]) -> Tree:
    """Per stateful hook, per cache context, the state object's attributes."""
    out: Tree = {}
    for path, manager in _stateful_hooks(denoisers):
        contexts = {}
        for ctx, state in manager._state_cache.items():
            fields = dict(vars(state))
            check(fields, f"cache {path} ({ctx})")
            contexts[ctx] = {k: list(v) if isinstance(v, list) else v for k, v in fields.items()}
        out[path] = contexts
    return out


def restore_hooks(denoisers: list[nn.Module], state: Tree) -> None:
    managers = dict(_stateful_hooks(denoisers))
    if set(managers) != set(state):
        raise Unkept(f"the step cache's hooks changed: kept {sorted(state)}, now {sorted(managers)}")
    for path, contexts in state.items():
        manager = managers[path]
        manager._state_cache.clear()
        for ctx, fields in contexts.items():
            obj = manager._state_cls(*manager._init_args, **manager._init_kwargs)
            for k, v in fields.items():
                setattr(obj, k, v)
            manager._state_cache[ctx] = obj


def take(scheduler: Any, denoisers: list[nn.Module], generator: torch.Generator) -> Tree:
    """The loop's state after a step (references, not copies: resume.py copies the tensors)."""
    return {"scheduler": scheduler_state(scheduler), "hooks": hook_states(denoisers),
            "generator": generator.get_state()}


def put(tree: Tree, scheduler: Any, denoisers: list[nn.Module], generator: torch.Generator) -> None:
    """``tree`` (its tensors already where they were taken from) back into a fresh loop that
    has run to the same step without computing."""
    restore_scheduler(scheduler, tree["scheduler"])
    restore_hooks(denoisers, tree["hooks"])
    generator.set_state(tree["generator"])


def scheduler_blocker(scheduler: Any, steps: int = 3) -> str:
    """Why ``scheduler``'s state cannot be kept ("" when it can): a copy of it run for a few
    steps on a small sample, taken after each."""
    import copy

    s = copy.deepcopy(scheduler)
    s.set_timesteps(steps)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 1, 2, 2, generator=g)
    try:
        scheduler_state(s)
        for t in s.timesteps:
            x = s.step(torch.randn(x.shape, generator=g), t, x, return_dict=False)[0]
            scheduler_state(s)
    except Unkept as e:
        return str(e)
    return ""
