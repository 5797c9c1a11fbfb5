"""CFG in one forward: a request's conditional and unconditional rows in one batch-2 forward.

diffusers' Wan pipelines call the denoiser twice per step under CFG: the conditional rows
inside ``cache_context("cond")``, then the unconditional ones inside ``cache_context("uncond")``,
with the same latents, timestep and image context and only the text context differing. Under
offload each call streams every block, so a CFG step fills each block twice. ``CfgBatched``
stands in for the denoiser in diffusers' own pipeline (its loop is not copied): the ``cond``
call runs one forward over ``[cond; uncond]`` rows and returns the first, the ``uncond`` call
that follows returns the second without a forward. The pipeline's guidance arithmetic and
scheduler step are untouched.

The negative text context is encoded before the pipeline runs (``encode``) and handed to the
pipeline as ``negative_prompt_embeds``, so the batcher knows the unconditional rows at the
conditional call. Batch 2 is not bitwise two batch-1 forwards on every device (a GEMM's
kernel may change with its row count): on CPU the default keeps batching off, and the
reference tests state the tolerance against diffusers' pipeline.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

TEXT_KEY = "encoder_hidden_states"


class CfgBatched:
    """A denoiser that answers the pipeline's cond/uncond pair with one forward of batch 2.

    Every attribute but the call and ``cache_context`` is the wrapped module's (config,
    dtype, ...), so the pipeline sees the model it expects. ``forwards`` counts the real
    forwards made (one per step).
    """

    def __init__(self, module: nn.Module, negative: torch.Tensor) -> None:
        self.__dict__.update(_module=module, _negative=negative, _branch=None, _pending=None, forwards=0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    @contextmanager
    def cache_context(self, name: str, **kwargs: Any) -> Iterator[None]:
        """The pipeline names the branch it is about to run: remember it, pass it on."""
        self.__dict__["_branch"] = name
        try:
            with self._module.cache_context(name, **kwargs):
                yield
        finally:
            self.__dict__["_branch"] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            raise TypeError("CfgBatched takes the pipeline's keyword call only")
        branch = self._branch
        if branch == "uncond":
            pending, self.__dict__["_pending"] = self._pending, None
            if pending is None:
                raise RuntimeError("CFG batch: an unconditional call with no conditional one before it")
            text = kwargs.get(TEXT_KEY)
            if text is not self._negative and not torch.equal(text, self._negative):
                raise RuntimeError("CFG batch: the unconditional call's text context is not the one batched")
            return pending
        if branch != "cond":
            raise RuntimeError(f"CFG batch: a denoiser call outside the cond/uncond contexts ({branch!r})")
        batched = {k: _pair(k, v, self._negative) for k, v in kwargs.items()}
        out = self._module(**batched)
        self.__dict__["forwards"] = self.forwards + 1
        cond, uncond = _split(out)
        self.__dict__["_pending"] = uncond
        return cond


def _pair(key: str, value: Any, negative: torch.Tensor) -> Any:
    """One keyword of the conditional call -> its batch-2 value: the text context gets the
    negative rows, every other tensor with a batch of 1 is repeated."""
    if key == TEXT_KEY:
        return torch.cat([value, negative.to(value.dtype)], dim=0)
    if isinstance(value, torch.Tensor) and value.ndim > 0:
        if value.shape[0] != 1:
            raise RuntimeError(f"CFG batch: {key} has batch {value.shape[0]}, one request's rows expected")
        return torch.cat([value, value], dim=0)
    return value


def _split(out: Any) -> tuple[Any, Any]:
    """The forward's output (a tuple with return_dict=False, or a dataclass) -> rows 0 and 1."""
    if isinstance(out, tuple):
        firsts, seconds = zip(*(_split(o) for o in out), strict=True)
        return tuple(firsts), tuple(seconds)
    if isinstance(out, torch.Tensor):
        return out[:1], out[1:]
    sample = out.sample  # Transformer2DModelOutput
    return type(out)(sample=sample[:1]), type(out)(sample=sample[1:])


def encode(pipe: Any, prompt: str, negative_prompt: str, max_sequence_length: int,
           device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The pipeline's own text encoding of both prompts, in the denoiser's dtype (as the
    pipeline casts them), so the batch sees exactly what the two calls would."""
    cond, negative = pipe.encode_prompt(prompt=prompt, negative_prompt=negative_prompt,
                                        do_classifier_free_guidance=True,
                                        max_sequence_length=max_sequence_length, device=device)
    return cond.to(dtype), negative.to(dtype)
