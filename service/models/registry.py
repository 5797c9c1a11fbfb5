"""Which adapter serves a pipeline folder: every family is imported here, and only here.

``adapter.py`` defines what a family is; the families import it; this module imports the
families. So nothing imports back up the chain (no circle between ``adapter`` and ``wan``).
"""

from __future__ import annotations

import os
from pathlib import Path

from .adapter import ModelAdapter, ModelError, read_index
from .flux import FluxAdapter
from .wan import WanAdapter

FAMILIES: tuple[type[ModelAdapter], ...] = (WanAdapter, FluxAdapter)


def families() -> dict[str, type[ModelAdapter]]:
    """Pipeline class name -> adapter class, for every supported family."""
    return {name: cls for cls in FAMILIES for name in cls.pipeline_classes}


def load_adapter(model_dir: str | Path, sequence_parallel: int = 1) -> ModelAdapter:
    """The adapter for a pipeline directory; ModelError naming the path if unsupported.

    ``sequence_parallel`` > 1 also checks that the model can be split that many ways and
    makes ``validate`` refuse requests whose tokens do not split evenly.
    """
    path, index = read_index(model_dir)
    known = families()
    name = index["_class_name"]
    if name not in known:
        raise ModelError(
            f"{path / 'model_index.json'}: unknown model family {name!r}; supported: {sorted(known)}"
        )
    adapter = known[name](path, index)
    if sequence_parallel != 1:
        adapter.set_sequence_parallel(sequence_parallel)
    return adapter


def resolve_model(model: str | os.PathLike | None) -> str:
    """An absolute model folder: the one given, or the tiny demo (written on first use)."""
    if model:
        return str(Path(model).expanduser().resolve())
    from .demo import ensure_demo_model

    return str(ensure_demo_model())
