"""A module kept in host memory and put on the device only for the call that needs it.

For a component that runs once per request and is small next to the transformer but
large next to its slots (a VAE decoder): its tensors live in pinned host memory, are
copied to the device right before use and dropped right after. The values are the same
bytes either way, so the outputs are bit for bit those of a resident module.
"""

from __future__ import annotations

import torch
from torch import nn

from .runtime import set_tensor


class StagedModule:
    """``module``'s parameters and buffers in (pinned) host memory; ``stage_in``/``stage_out``."""

    def __init__(self, module: nn.Module, device: str | torch.device) -> None:
        self.module = module
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        self.host: dict[str, torch.Tensor] = {}
        sd = module.state_dict(keep_vars=True)
        extra = [(n, b) for n, b in module.named_buffers() if n not in sd]  # non-persistent
        for name, t in list(sd.items()) + extra:
            h = t.detach().to("cpu")
            self.host[name] = h.pin_memory() if pin else h
            set_tensor(module, name, self.host[name])
        self.staged = False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host.values())

    def stage_in(self) -> None:
        """Copy every tensor to the device (on the current stream: ordered before its use)."""
        if self.staged:
            return
        for name, h in self.host.items():
            set_tensor(self.module, name, h.to(self.device, non_blocking=True))
        self.staged = True

    def stage_out(self) -> None:
        """Point the module back at the host copies; the device copies are freed."""
        if not self.staged:
            return
        for name, h in self.host.items():
            set_tensor(self.module, name, h)
        self.staged = False
