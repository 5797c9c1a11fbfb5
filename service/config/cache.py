"""A request's step cache: the method and its parameters, checked without torch.

``CacheSpec`` is what a request carries (``GenerationRequest.cache``), what the HTTP body's
``cache`` object and ``--cache`` become; ``service.models.cache`` applies it to the
transformer for one request (diffusers' own cache hooks). Methods:

- ``none``: every block of every forward runs (the default).
- ``first_block``: diffusers' First Block Cache (``FirstBlockCacheConfig``): block 0 runs;
  when the change of its residual since the last full forward, relative to it, is at most
  ``threshold``, the other blocks are skipped and their cached residual is added instead.
- ``mag``: diffusers' MagCache (``MagCacheConfig``): a whole forward is skipped while the
  error accumulated from the model's per-step magnitude ratios (``mag_ratios``, measured
  for a checkpoint and scheduler) stays under ``threshold``, at most ``max_skip_steps`` in
  a row, never in the first ``retention_ratio`` of the steps.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from .errors import FieldError

METHODS = ("none", "first_block", "mag")
PARAMS = {
    "none": {},
    "first_block": {"threshold": 0.05},
    "mag": {"threshold": 0.06, "max_skip_steps": 3, "retention_ratio": 0.2, "mag_ratios": None},
}
MAX_RATIOS = 1000


class CacheError(FieldError):
    """A cache spec is invalid; ``field`` names the part (``cache.threshold``)."""


@dataclass(frozen=True)
class CacheSpec:
    """One step cache and its parameters (None: the method's default)."""

    method: str = "none"
    threshold: float | None = None
    max_skip_steps: int | None = None
    retention_ratio: float | None = None
    mag_ratios: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.mag_ratios is not None and not isinstance(self.mag_ratios, tuple):
            if isinstance(self.mag_ratios, list):
                object.__setattr__(self, "mag_ratios", tuple(self.mag_ratios))

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def value(self, name: str) -> Any:
        """A parameter, or the method's default."""
        v = getattr(self, name)
        return PARAMS[self.method][name] if v is None else v

    def check(self) -> None:
        """Raise CacheError naming the field: unknown method, a parameter the method does not
        take, or a value out of range."""
        if not isinstance(self.method, str) or self.method not in METHODS:
            raise CacheError("cache.method", f"must be one of {list(METHODS)}, got {self.method!r}")
        for name in ("threshold", "max_skip_steps", "retention_ratio", "mag_ratios"):
            if getattr(self, name) is not None and name not in PARAMS[self.method]:
                raise CacheError(f"cache.{name}", f"is not a parameter of {self.method!r} "
                                 f"(it takes {sorted(PARAMS[self.method]) or 'none'})")
        if self.threshold is not None:
            _number("cache.threshold", self.threshold, 0.0, 10.0)
        if self.max_skip_steps is not None:
            v = self.max_skip_steps
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 1000:
                raise CacheError("cache.max_skip_steps", f"must be an integer in [0, 1000], got {v!r}")
        if self.retention_ratio is not None:
            _number("cache.retention_ratio", self.retention_ratio, 0.0, 1.0)
        if self.method == "mag":
            r = self.mag_ratios
            if r is None:
                raise CacheError("cache.mag_ratios", "required for 'mag': the magnitude ratio of each step, "
                                 "measured for this checkpoint and scheduler (diffusers' MagCacheConfig "
                                 "calibrate=True prints them)")
            if not isinstance(r, tuple) or not 1 <= len(r) <= MAX_RATIOS:
                raise CacheError("cache.mag_ratios", f"must be a list of 1 to {MAX_RATIOS} numbers")
            for i, x in enumerate(r):
                _number(f"cache.mag_ratios[{i}]", x, 0.0, 100.0)

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON, only what was given (the canonical form of ``--cache``)."""
        d: dict[str, Any] = {"method": self.method}
        for name in ("threshold", "max_skip_steps", "retention_ratio", "mag_ratios"):
            v = getattr(self, name)
            if v is not None:
                d[name] = list(v) if isinstance(v, tuple) else v
        return d

    @classmethod
    def from_obj(cls, obj: Any) -> CacheSpec:
        """A mapping (HTTP, a batch line), a spec string, or a CacheSpec; checked."""
        if isinstance(obj, CacheSpec):
            spec = obj
        elif isinstance(obj, str):
            spec = parse_spec(obj)
        elif isinstance(obj, dict):
            unknown = sorted(set(obj) - set(cls.__dataclass_fields__))
            if unknown:
                known = sorted(cls.__dataclass_fields__)
                raise CacheError(f"cache.{unknown[0]}", f"unknown parameter (known: {known})")
            if "method" not in obj:
                raise CacheError("cache.method", f"missing; one of {list(METHODS)}")
            spec = cls(**obj)
        else:
            raise CacheError("cache", f"must be an object like {{\"method\": \"first_block\"}}, got {obj!r}")
        spec.check()
        return spec


def parse_spec(text: str) -> CacheSpec:
    """``--cache``: ``METHOD``, ``METHOD:key=value,key=value`` or a JSON object."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise CacheError("cache", f"invalid JSON: {e}") from None
        return CacheSpec.from_obj(obj)
    method, _, rest = text.partition(":")
    obj: dict[str, Any] = {"method": method.strip()}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise CacheError("cache", f"expected key=value, got {item!r}")
        try:
            obj[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            raise CacheError(f"cache.{key.strip()}", f"must be a number, got {value!r}") from None
    return CacheSpec.from_obj(obj)


def _number(field: str, value: object, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CacheError(field, f"must be a number, got {value!r}")
    if not lo <= float(value) <= hi:
        raise CacheError(field, f"must be in [{lo}, {hi}], got {value}")
