"""Where the transformer's weights live: ``--dlo-*`` (the Serve config's ``offload`` mapping).

The mode is the offload library's own ``OffloadMode``; there is no second spelling of it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from service.offload.mode import STREAMED, OffloadMode

from .errors import FlagError

COMPONENTS = ("dit", "text_encoder", "vae")
NEEDS_OFFLOAD = "needs --enable-distributed-layerwise-offload"
# The mode when offload is asked for and no --dlo-mode is given (flags and the Serve config).
STREAMED_DEFAULT = OffloadMode.AUTO
PROBE_SHAPE = (480, 832, 81)  # (height, width, frames) of the probe forward when none is given
# The share of a GPU's memory the streamed transformer's weights may take (its resident blocks,
# the two slots, the non-block tensors) when no flag places the blocks: a model that fits keeps
# its blocks on the device instead of streaming them (short clips are transfer-bound); the
# activations, the text encoder and VAE, and a standby's copy use the rest.
DEVICE_SHARE = 0.4


@dataclass(frozen=True)
class OffloadConfig:
    """Where the weights live, checked when made (FlagError names the flag).

    ``mode``: RESIDENT (nothing streams, the default), ALLGATHER, RANK_LOCAL or AUTO (resolved
    once at load by the probe: ``service.models.automode.decide_auto``).
    ``resident_layers`` / ``device_memory_gb``: transformer blocks kept on the device;
    ``device_share``: where neither is given, on CUDA, as many as fit in this share of the
    GPU's memory (0: stream every block).
    ``components``: what offload covers besides the transformer (text encoder, VAE).
    ``probe_shape``: (height, width, frames) of the load-time probe forward (auto mode and
    the memory budget); None is ``PROBE_SHAPE``.
    """

    mode: OffloadMode = OffloadMode.RESIDENT
    resident_layers: int | None = None
    device_memory_gb: float | None = None
    device_share: float = DEVICE_SHARE
    components: tuple[str, ...] = ("dit",)
    probe_shape: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", OffloadMode(self.mode))
        except ValueError:
            raise FlagError(f"--dlo-mode must be one of {[m.value for m in OffloadMode]}, "
                            f"got {self.mode!r}") from None
        object.__setattr__(self, "components", parse_components(self.components))
        if self.probe_shape is not None:
            shape = tuple(int(v) for v in self.probe_shape)
            if len(shape) != 3 or min(shape) < 1:
                raise FlagError(f"--dlo-probe-size: three positive sizes, got {self.probe_shape!r}")
            object.__setattr__(self, "probe_shape", shape)
        if not 0 <= self.device_share < 1:
            raise FlagError(f"--dlo-device-share must be in [0, 1), got {self.device_share}")
        if self.resident_layers is not None and self.resident_layers < 0:
            raise FlagError(f"--dlo-resident-layers must be >= 0, got {self.resident_layers}")
        if self.device_memory_gb is not None:
            if not self.device_memory_gb > 0:
                raise FlagError(f"--dlo-device-memory-gb must be > 0, got {self.device_memory_gb}")
            if self.resident_layers is not None:
                raise FlagError("give --dlo-resident-layers or --dlo-device-memory-gb, not both")
        if self.mode is OffloadMode.RESIDENT:
            placed = [flag for flag, value in (("--dlo-resident-layers", self.resident_layers),
                                               ("--dlo-device-memory-gb", self.device_memory_gb),
                                               ("--dlo-probe-size", self.probe_shape)) if value is not None]
            if self.components != ("dit",):
                placed.append("--dlo-components")
            if placed:
                raise FlagError(f"{', '.join(placed)}: {NEEDS_OFFLOAD}")

    @property
    def enabled(self) -> bool:
        """Whether the transformer streams from host memory."""
        return self.mode.streams

    @property
    def probed(self) -> bool:
        """Whether loading runs a probe forward first (auto mode; a budget, on CUDA)."""
        return self.mode is OffloadMode.AUTO or self.device_memory_gb is not None

    def resolved(self, mode: OffloadMode) -> OffloadConfig:
        """The same settings with auto's choice in place."""
        if mode not in STREAMED:
            raise ValueError(f"auto resolves to allgather or rank-local, not {mode.value}")
        return replace(self, mode=mode)


def parse_components(value: str | tuple[str, ...] | list[str] | None, flag: str = "--dlo-components"
                     ) -> tuple[str, ...]:
    """``"dit,text_encoder,vae"`` -> a checked tuple in canonical order; FlagError naming ``flag``."""
    if value is None:
        return ("dit",)
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)
    bad = sorted(set(items) - set(COMPONENTS))
    if bad or not items:
        raise FlagError(f"{flag}: unknown component(s) {bad or items}; choose from {list(COMPONENTS)}")
    if "dit" not in items:
        raise FlagError(f"{flag}: must include 'dit' (the transformer is what offload streams first)")
    return tuple(c for c in COMPONENTS if c in items)


def parse_probe_size(value: str) -> tuple[int, int, int]:
    """``"832x480x81"`` -> (height, width, frames)."""
    m = re.fullmatch(r"\s*(\d+)x(\d+)x(\d+)\s*", value)
    if not m or min(int(g) for g in m.groups()) < 1:
        raise FlagError(f"--dlo-probe-size must be WIDTHxHEIGHTxFRAMES like 832x480x81, got {value!r}")
    w, h, f = (int(g) for g in m.groups())
    return (h, w, f)
