"""Which adapter serves a pipeline folder: every family is imported here, and only here.

``adapter.py`` defines what a family is; the families import it; this module imports the
families. So nothing imports back up the chain (no circle between ``adapter`` and ``wan``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .adapter import ModelAdapter, ModelError, read_index
from .flux import FluxAdapter
from .wan import WanAdapter
from .wan22 import Wan22Adapter, Wan22TI2VAdapter
from .wan_i2v import Wan22I2VAdapter, WanI2VAdapter

# One pipeline class can serve several families (WanPipeline: Wan2.1 T2V, Wan2.2 A14B T2V,
# TI2V-5B); each family's ``accepts`` tells them apart from the index.
FAMILIES: tuple[type[ModelAdapter], ...] = (
    WanAdapter, Wan22Adapter, Wan22TI2VAdapter, WanI2VAdapter, Wan22I2VAdapter, FluxAdapter)


def families() -> dict[str, list[type[ModelAdapter]]]:
    """Pipeline class name -> the adapter classes that may serve it, for every family."""
    out: dict[str, list[type[ModelAdapter]]] = {}
    for cls in FAMILIES:
        for name in cls.pipeline_classes:
            out.setdefault(name, []).append(cls)
    return out


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
    matching = [cls for cls in known[name] if cls.accepts(index)]
    if not matching:
        raise ModelError(f"{path / 'model_index.json'}: a {name} with this layout is not supported "
                         f"(families of {name}: {[c.family for c in known[name]]})")
    adapter = matching[0](path, index)
    if sequence_parallel != 1:
        adapter.set_sequence_parallel(sequence_parallel)
    return adapter


# A model folder's own default request: what it was trained for (its size, frames, steps, guidance).
DEFAULTS_FILE = "dloserve_defaults.json"
DEFAULT_FIELDS: dict[str, tuple[type, ...]] = {
    "width": (int,), "height": (int,), "num_frames": (int,), "fps": (int,), "num_inference_steps": (int,),
    "guidance_scale": (int, float), "flow_shift": (int, float), "negative_prompt": (str,)}


def resolve_model(model: str | os.PathLike | None) -> str:
    """An absolute model folder: the one given, or the trained demo model (committed)."""
    if model:
        return str(Path(model).expanduser().resolve())
    from .demo.shapes import model_dir

    return str(model_dir())


def request_defaults(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The folder's default request (``dloserve_defaults.json``; {} without one): the values a
    request that leaves a field out gets, before the service's own. ModelError names the file."""
    path = Path(model_dir) / DEFAULTS_FILE
    if not path.is_file():
        return {}
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: not a JSON object ({e})") from None
    if not isinstance(values, dict):
        raise ModelError(f"{path}: not a JSON object")
    for key, value in values.items():
        kinds = DEFAULT_FIELDS.get(key)
        if kinds is None:
            raise ModelError(f"{path}: {key!r} is not a request default (one of {sorted(DEFAULT_FIELDS)})")
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise ModelError(f"{path}: {key!r} must be {' or '.join(k.__name__ for k in kinds)}, "
                             f"got {value!r}")
    return values
