"""Package names resolved on first use (PEP 562), so importing a package costs only what is
used: ``service.offload`` (its mode enum needs no torch) and ``service.models``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``where`` maps each name to its submodule."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f".{where[name]}", package), name)

    return __getattr__
