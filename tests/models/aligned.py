"""diffusers' own pipelines as references, with their denoisers' weights where dloserve puts
them: a view off a 64-byte boundary copied (``compute_aligned``, offload/checkpoint.py).

``from_pretrained`` leaves a transformer's tensors as views of the safetensors mapping, at
whatever alignment the file gives; a CPU BLAS picks its kernel by alignment, so the last bits
of diffusers' frames follow the file's offsets. dloserve's do not (docs/determinism.md): the
references compare the arithmetic on equally aligned weights.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from service.offload.checkpoint import compute_aligned
from service.offload.runtime import set_tensor

DENOISERS = ("transformer", "transformer_2")


def align(module: nn.Module) -> None:
    """Every parameter and buffer of ``module`` on a 64-byte boundary (copied where not)."""
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        moved = compute_aligned(t.data)
        if moved is not t.data:
            set_tensor(module, name, moved)


def aligned_denoisers(pipe: Any) -> Any:
    """``pipe`` with its denoisers' weights aligned as dloserve's are; returned for chaining."""
    for name in DENOISERS:
        module = getattr(pipe, name, None)
        if module is not None:
            align(module)
    return pipe
