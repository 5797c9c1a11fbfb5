"""A request's use of a LoRA adapter, and the ``--lora`` flag: plain data, no torch.

A request names adapters (``LoraRef(name, scale, expert)``); the front end that accepted it
(the service, the batch job, ``generate``) resolves each name against its registry and
fills ``source`` and ``sha256``: where the file is and which bytes were checked. A rank
needs nothing else to load it, so a registry can change (an adapter deleted, another
added) while requests that already resolved run on unchanged, and no RPC to the ranks
exists for it. The adapter set is deliberately not in the compatibility key: adapters
change no collective call (the AllGather moves base weights only).
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from service.config.errors import FlagError

EXPERTS = ("both", "high", "low")  # Wan2.2 A14B: high-noise (transformer), low-noise (transformer_2)
MAX_LORAS = 8  # adapters in one request
MAX_LORAS_PER_KEY = 32  # adapters one API key may register at run time (the server's are not counted)
MAX_SCALE = 10.0
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class LoraError(ValueError):
    """An adapter cannot be served; names the adapter and the offending key (or "file")."""

    def __init__(self, adapter: str, key: str, message: str) -> None:
        super().__init__(f"adapter {adapter!r}: {key}: {message}")
        self.adapter, self.key, self.message = adapter, key, message

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:
        return type(self), (self.adapter, self.key, self.message)


@dataclass(frozen=True)
class LoraRef:
    """One adapter in one request. ``expert`` None: the registration's (default "both").

    ``scale`` multiplies the adapter's own ``lora_alpha / r``, as diffusers' ``set_adapters``
    weights do. ``source``/``sha256`` are empty until a registry resolved the name.
    """

    name: str
    scale: float = 1.0
    expert: str | None = None
    source: str = ""
    sha256: str = ""

    @property
    def resolved(self) -> bool:
        return bool(self.source and self.sha256)

    def public(self) -> dict[str, object]:
        """What a client sees of it (the video object, the batch manifest): never the path."""
        return {"name": self.name, "scale": self.scale, "expert": self.expert or "both",
                "sha256": self.sha256 or None}


def name_problem(name: object) -> str | None:
    """Why ``name`` cannot name an adapter, or None (names become file names: kept plain)."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        return f"must be 1-64 characters of [A-Za-z0-9_.-], starting with a letter or digit, got {name!r}"
    return None


def lora_problem(refs: object) -> tuple[str, str] | None:
    """(field, message) of the first bad entry of a request's ``loras``, or None."""
    if not isinstance(refs, tuple) or not all(isinstance(r, LoraRef) for r in refs):
        return "loras", "must be a list of {name, scale, expert} objects"
    if len(refs) > MAX_LORAS:
        return "loras", f"at most {MAX_LORAS} adapters per request, got {len(refs)}"
    seen: set[str] = set()
    for i, r in enumerate(refs):
        why = name_problem(r.name)
        if why:
            return f"loras[{i}].name", why
        if r.name in seen:
            return f"loras[{i}].name", f"adapter {r.name!r} is named twice"
        seen.add(r.name)
        s = r.scale
        if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s) \
                or abs(s) > MAX_SCALE:
            return f"loras[{i}].scale", f"must be a number in [-{MAX_SCALE:g}, {MAX_SCALE:g}], got {s!r}"
        if r.expert is not None and r.expert not in EXPERTS:
            return f"loras[{i}].expert", f"must be one of {list(EXPERTS)}, got {r.expert!r}"
    return None


# -- the flag -----------------------------------------------------------------------------


def parse_lora_flag(value: str) -> tuple[str, str, float | None]:
    """``NAME=SOURCE`` -> (name, source, None); ``NAME[:SCALE]`` -> (name, "", scale)."""
    if "=" in value:
        name, source = value.split("=", 1)
        if not source.strip():
            raise FlagError(f"--lora {value!r}: give NAME=PATH")
        scale = None
    else:
        name, _, raw = value.partition(":")
        source = ""
        try:
            scale = float(raw) if raw else 1.0
        except ValueError:
            raise FlagError(f"--lora {value!r}: the scale after ':' must be a number") from None
        if not math.isfinite(scale) or abs(scale) > MAX_SCALE:
            raise FlagError(f"--lora {value!r}: the scale must be in [-{MAX_SCALE:g}, {MAX_SCALE:g}]")
    why = name_problem(name)
    if why:
        raise FlagError(f"--lora {value!r}: the name {why}")
    return name, source.strip(), scale


def source_problem(source: str) -> str | None:
    """Why ``source`` cannot be a registered adapter, from the path alone (the file's contents are
    checked where it is registered): said before anything starts, not by the replica."""
    if "://" in source:
        return "adapters are local files (URL sources are not supported yet)"
    path = Path(os.path.expanduser(source))
    if not path.exists():
        return "no such file"
    if not path.is_file():
        return "not a file: give the adapter's .safetensors file"
    return None


def lora_flags(args: argparse.Namespace, uses_allowed: bool = False
               ) -> tuple[list[tuple[str, str]], list[LoraRef]]:
    """(registrations as (name, source), uses) of the ``--lora`` flags; FlagError naming one."""
    regs: list[tuple[str, str]] = []
    uses: list[LoraRef] = []
    for value in getattr(args, "lora", None) or []:
        name, source, scale = parse_lora_flag(value)
        if scale is None:
            if any(n == name for n, _ in regs):
                raise FlagError(f"--lora {name}=...: the name is registered twice")
            problem = source_problem(source)
            if problem:
                raise FlagError(f"--lora {value!r}: {problem}")
            regs.append((name, source))
        elif not uses_allowed:
            raise FlagError(f"--lora {value!r}: register adapters here as NAME=PATH; requests name "
                            "the adapters they use (\"loras\": [{\"name\": ..., \"scale\": ...}])")
        else:
            uses.append(LoraRef(name, scale))
    if uses_allowed and regs and not uses:
        uses = [LoraRef(n) for n, _ in regs]
    problem = lora_problem(tuple(uses))
    if problem:
        raise FlagError(f"--lora: {problem[1]}")
    return regs, uses
