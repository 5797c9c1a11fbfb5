"""A request's state after a denoising step, and how a rerun starts from it.

What a flow-matching Euler request needs to go on from step ``k`` is its latents after
step ``k``: the scheduler's sigmas, the text embeddings and the generator's draws all
follow from the request again (the generator only draws the initial noise, which the
saved latents replace). So ``StepState`` is the step index and the latents' bytes (any
dtype, bf16 included, kept bit for bit), plain data that pickles without torch.

A rerun runs diffusers' own pipeline from step 0 with ``latents=`` the saved ones and a
stand-in denoiser (``Resumed``) that, for the first ``k`` steps, returns zeros without a
transformer forward: ``FlowMatchEulerDiscreteScheduler.step`` computes
``(sample.float() + dt * 0).to(output dtype)``, which is the sample itself, bit for bit,
when the zeros have the saved latents' dtype (x + -0.0 is x, even for -0.0; the float32
round trip of a bf16 or float32 value is exact). The later steps see the same tensors as
an uninterrupted run's, so the MP4 bytes are equal (tests/models/test_resume.py).

Other schedulers keep history between steps (UniPC, Wan2.1's published one, keeps its
last model outputs), a step cache keeps residuals, two experts switch on the step: such
requests are not resumable here and rerun from step 0 (``resumable``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

RESUMABLE_SCHEDULERS = ("FlowMatchEulerDiscreteScheduler",)


@dataclass(frozen=True)
class StepState:
    """The latents after ``step`` of ``total`` steps, as raw bytes with dtype and shape."""

    step: int
    total: int
    dtype: str  # torch dtype name: "float32", "bfloat16", ...
    shape: tuple[int, ...]
    data: np.ndarray = field(repr=False)  # uint8, the tensor's bytes (C order)

    @classmethod
    def of(cls, step: int, total: int, latents: torch.Tensor) -> StepState:
        """A copy of ``latents`` (any device) in host memory."""
        host = latents.detach().to("cpu", copy=True).contiguous()
        return cls.wrap(step, total, host)

    @classmethod
    def wrap(cls, step: int, total: int, host: torch.Tensor) -> StepState:
        """``host`` (a contiguous CPU tensor this state now owns) without another copy."""
        raw = host.reshape(-1).view(torch.uint8).numpy()
        return cls(step, total, str(host.dtype).removeprefix("torch."), tuple(host.shape), raw)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The latents again, on ``device``, bit for bit."""
        raw = torch.from_numpy(np.ascontiguousarray(self.data))
        return raw.view(getattr(torch, self.dtype)).reshape(self.shape).to(device)


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
