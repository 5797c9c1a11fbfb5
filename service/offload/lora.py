"""LoRA side branches on streamed (or resident) Linears, and the device cache of adapters.

The base weights are never touched: a slot holds the same bytes with or without adapters,
the host shards and the page cache are only ever read. An adapter is a pair of small
factors per Linear, kept on the device; a forward hook adds its branch to the Linear's
output, in PEFT's order of operations and dtypes (``peft.tuners.lora.layer.Linear``):

    result = base(x)
    for each active adapter: x = x.to(A.dtype); result = result + B(A(x)) * scaling
    result = result.to(base dtype)

so a transformer served here gives the bytes diffusers gives after ``load_lora_weights`` and
``set_adapters``. The hook fires wherever the Linear's weight is at that moment (a slot
filled by a gather, a resident block, a non-block module), so streaming is unchanged: the
AllGather still moves base weights only, and ranks of one group run different adapters
(or none) at the same forward. A rank that only replays gathers runs no Linear at all.

``AdapterCache`` keeps whole adapters on the device under a byte budget, least recently
used first out; an adapter in use by the request being set up is never evicted.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle


@dataclass(frozen=True)
class LoraFactors:
    """One Linear's adapter: ``down`` (A, [r, in]), ``up`` (B, [out, r]) and B's optional bias."""

    down: torch.Tensor
    up: torch.Tensor
    bias: torch.Tensor | None
    alpha: float
    rank: int
    rslora: bool = False

    def scaling(self, scale: float) -> float:
        """PEFT's ``set_scale``: ``scale * lora_alpha / r`` (rsLoRA: ``/ sqrt(r)``), in that order."""
        return scale * self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @property
    def nbytes(self) -> int:
        ts = [self.down, self.up] + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in ts)

    def to(self, device: torch.device, dtype: torch.dtype) -> LoraFactors:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, dtype).contiguous()

        return LoraFactors(move(self.down), move(self.up), move(self.bias),  # type: ignore[arg-type]
                           self.alpha, self.rank, self.rslora)


@dataclass
class DeviceAdapter:
    """One adapter's factors on the device, by module name."""

    key: str
    layers: dict[str, LoraFactors]
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(f.nbytes for f in self.layers.values())


class AdapterCache:
    """Whole adapters on one device, least recently used first out, under ``budget`` bytes."""

    def __init__(self, budget: int) -> None:
        self.budget = int(budget)
        self._entries: OrderedDict[str, DeviceAdapter] = OrderedDict()
        self.hits = self.misses = self.evictions = 0

    @property
    def used(self) -> int:
        return sum(a.nbytes for a in self._entries.values())

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def nbytes(self, key: str) -> int:
        return self._entries[key].nbytes

    def get(self, key: str) -> DeviceAdapter:
        return self._entries[key]

    def keys(self) -> list[str]:
        """Cached keys, least recently used first."""
        return list(self._entries)

    def acquire(self, wanted: list[tuple[str, int, Callable[[], DeviceAdapter]]]) -> list[DeviceAdapter]:
        """The adapters ``wanted`` as (key, device bytes, loader), cached or loaded, in order.

        Room is made by evicting the least recently used adapters outside ``wanted``;
        ValueError (naming the sizes) if the set alone is over the budget.
        """
        need = sum(n for k, n, _ in {k: (k, n, f) for k, n, f in wanted}.values())
        if need > self.budget:
            raise ValueError(f"the request's adapters need {need / 2**20:.1f} MiB of device memory, over "
                             f"the LoRA cache of {self.budget / 2**20:.1f} MiB (--lora-cache-gb)")
        keep = {k for k, _, _ in wanted}
        out: list[DeviceAdapter] = []
        for key, nbytes, load in wanted:
            entry = self._entries.get(key)
            if entry is not None:
                self.hits += 1
                self._entries.move_to_end(key)
                out.append(entry)
                continue
            self.misses += 1
            for old in [k for k in self._entries if k not in keep]:
                if self.used + nbytes <= self.budget:
                    break
                del self._entries[old]
                self.evictions += 1
            entry = load()
            self._entries[key] = entry
            out.append(entry)
        return out

    def clear(self) -> None:
        self._entries.clear()

    def stats(self) -> dict[str, int]:
        return {"budget_bytes": self.budget, "used_bytes": self.used, "adapters": len(self._entries),
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions}


Branch = tuple[LoraFactors, float]  # factors and their scaling (scale * alpha / r)


def _side_branch(branches: list[Branch]) -> Callable[..., torch.Tensor]:
    def hook(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
        x = args[0] if args else kwargs["input"]
        result = output
        dtype = result.dtype
        for f, scaling in branches:
            if x.dtype != f.down.dtype:
                x = x.to(f.down.dtype)
            result = result + F.linear(F.linear(x, f.down), f.up, f.bias) * scaling
        return result.to(dtype)

    return hook


class SideBranches:
    """Forward hooks that add one request's adapters to a module's Linears; none when idle.

    ``attach`` installs a hook only on the Linears some active adapter changes, so a request
    without adapters runs exactly the plain module. ``detach`` removes them (always called,
    also when the request failed).
    """

    def __init__(self, module: nn.Module, linears: dict[str, nn.Module]) -> None:
        self.module = module
        self.linears = linears
        self._handles: list[RemovableHandle] = []

    @property
    def attached(self) -> int:
        return len(self._handles)

    def attach(self, active: list[tuple[DeviceAdapter, float]]) -> None:
        """Add each (adapter, scale) in order: the order PEFT sums them in (``set_adapters``)."""
        self.detach()
        per_module: dict[str, list[Branch]] = {}
        for adapter, scale in active:
            for name, f in adapter.layers.items():
                if name not in self.linears:
                    raise KeyError(f"adapter {adapter.key[:12]}: no Linear {name!r} in this module")
                per_module.setdefault(name, []).append((f, f.scaling(scale)))
        for name, branches in per_module.items():
            self._handles.append(self.linears[name].register_forward_hook(
                _side_branch(branches), with_kwargs=True))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
