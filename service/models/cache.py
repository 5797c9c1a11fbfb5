"""Step caches per request: diffusers' own cache hooks, and the offload told what they skip.

A request's ``CacheSpec`` becomes diffusers' ``FirstBlockCacheConfig`` or ``MagCacheConfig``,
enabled on the transformer (``CacheMixin.enable_cache``) for that request only and removed
after it, so the frames are the library's own. Both hook a block's ``forward``; our offload
hooks are torch forward hooks around the whole call, so they compose: a skipped block is
still called (as a pass-through) and the offload's pre-hook asks, at its decision points
(before block 0 and before block 1), whether this rank will run the block
(``LayerwiseOffload.set_vote``). Where no rank will, nothing more is filled in that forward.

- First Block Cache decides after block 0 from its residual: the vote before block 1 reads
  the decision its head hook stored (``should_compute``); block 0 always runs.
- MagCache decides inside block 0's hook, after our pre-hook has run: the vote before block
  0 evaluates the same rule on the hook's state without changing it (``_mag_would_compute``),
  and the vote before block 1 reads what the hook then decided. Should they ever differ the
  block that needed weights fails loudly (it would run on the offload's empty placeholders).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from service.config.cache import CacheSpec

from .checks import cache_unsupported

log = logging.getLogger("dloserve.models")
DECISION_POINTS = (0, 1)  # block indices: before the forward's first block, and after it


def diffusers_config(spec: CacheSpec, num_inference_steps: int) -> Any:
    """The diffusers cache config of ``spec`` (None for ``none``)."""
    if spec.method == "first_block":
        from diffusers.hooks import FirstBlockCacheConfig

        return FirstBlockCacheConfig(threshold=float(spec.value("threshold")))
    if spec.method == "mag":
        from diffusers.hooks import MagCacheConfig

        return MagCacheConfig(threshold=float(spec.value("threshold")),
                              max_skip_steps=int(spec.value("max_skip_steps")),
                              retention_ratio=float(spec.value("retention_ratio")),
                              num_inference_steps=num_inference_steps,
                              mag_ratios=list(spec.value("mag_ratios")))
    return None


class StepCaches:
    """The step cache of the request running on this rank (one at a time, like adapters)."""

    def __init__(self, transformer: nn.Module, handle: Any, adapter: Any, default: CacheSpec | None) -> None:
        self.transformer = transformer
        self.handle = handle
        self.unsupported = cache_unsupported(adapter)
        self.blocks: nn.ModuleList | None = (
            None if self.unsupported else getattr(transformer, adapter.block_attrs[0]))
        self.default = default if default is not None else CacheSpec()
        if self.unsupported and self.default.enabled:
            raise ValueError(f"--cache: {self.unsupported}")
        self.agree_over(None)

    def agree_over(self, group: Any) -> None:
        """Decide at the offload's decision points; an AllGather group agrees over ``group`` (a
        gloo group of the same ranks, the rank worker's control group: no device sync), else over
        the offload's own group."""
        if self.handle is not None and not self.unsupported:
            self.handle.enable_skips(DECISION_POINTS, agree_group=group)

    def resolve(self, spec: CacheSpec | None) -> CacheSpec:
        """The request's cache, or the server default when it names none."""
        return self.default if spec is None else spec

    @contextmanager
    def applied(self, spec: CacheSpec, num_inference_steps: int) -> Iterator[None]:
        """``spec``'s hooks on the transformer (and the offload's vote) for one request."""
        if not spec.enabled:
            yield
            return
        self.transformer.enable_cache(diffusers_config(spec, num_inference_steps))
        try:
            if self.handle is not None:
                self.handle.set_vote(self._vote(spec))
            yield
        finally:
            if self.handle is not None:
                self.handle.set_vote(None)
            self.transformer.disable_cache()

    def _head(self, name: str) -> Any:
        assert self.blocks is not None
        return self.blocks[0]._diffusers_hook.get_hook(name)

    def _vote(self, spec: CacheSpec) -> Callable[[int], bool]:
        if spec.method == "first_block":
            from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK

            head = self._head(_FBC_LEADER_BLOCK_HOOK)

            def first_block(block: int) -> bool:
                return block == 0 or bool(head.state_manager.get_state().should_compute)

            return first_block
        from diffusers.hooks.mag_cache import _MAG_CACHE_LEADER_BLOCK_HOOK

        head = self._head(_MAG_CACHE_LEADER_BLOCK_HOOK)

        def mag(block: int) -> bool:
            state = head.state_manager.get_state()
            if block == 0:  # the head hook has not decided yet: the same rule, read-only
                return _mag_would_compute(head.config, state)
            return bool(state.should_compute)

        return mag


def _mag_would_compute(config: Any, state: Any) -> bool:
    """diffusers' ``MagCacheHeadHook.new_forward`` decision (0.42.1), without its side effects."""
    if config.calibrate:
        return True
    step = state.step_index
    scale = 1.0 if step >= len(config.mag_ratios) else config.mag_ratios[step]
    if step < int(config.retention_ratio * config.num_inference_steps + 0.5):
        return True
    ratio = state.accumulated_ratio * scale
    err = state.accumulated_err + abs(1.0 - ratio)
    skip = (state.previous_residual is not None and err <= config.threshold
            and state.accumulated_steps + 1 <= config.max_skip_steps)
    return not bool(skip.item() if isinstance(skip, torch.Tensor) else skip)
