"""The stand-in denoiser of a rerun from a saved step (models/resume.py holds the step's data).

A rerun runs diffusers' own pipeline from step 0 with a stand-in denoiser (``Resumed``)
that, for the first ``k`` steps, returns zeros without a transformer forward; the scheduler
steps on them cost nothing worth counting. After step ``k - 1`` the step callback puts the
loop's state back and hands the pipeline the saved latents, so step ``k`` on sees the
tensors of an uninterrupted run and the MP4 bytes are equal (tests/models/test_resume.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .resume import StepState


class Resumed(nn.Module):
    """The denoiser as the pipeline sees it on a rerun from step ``start``: zeros of the
    latents' shape and dtype, no forward, until ``done`` (set by the step callback) reaches
    ``start``; the real module after that. Everything else (config, dtype, device, the
    cache context) is the real module's. The real one is not a child: nothing walks it twice."""

    def __init__(self, real: nn.Module, state: StepState, device: torch.device) -> None:
        super().__init__()
        object.__setattr__(self, "_real", real)
        self.start = state.step
        self.done = 0  # steps finished so far in this run
        self._zeros = torch.zeros(state.shape, dtype=getattr(torch, state.dtype), device=device)

    @property
    def device(self) -> torch.device:
        return self._real.device

    @property
    def dtype(self) -> torch.dtype:
        return self._real.dtype

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_real"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.done >= self.start:
            return self._real(*args, **kwargs)
        if kwargs.get("return_dict", True):
            from diffusers.models.modeling_outputs import Transformer2DModelOutput

            return Transformer2DModelOutput(sample=self._zeros)
        return (self._zeros,)
