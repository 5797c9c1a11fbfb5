"""``--dlo-mode auto``'s probe timings kept between starts (the probe cache), keyed by what they
depend on (``probe_facts``): the GPU model and count, torch's version, the checkpoint's
safetensors headers and config.json, the model settings, the probe size, the SP size and
``PROBE_VERSION``. One JSON file per key in ``$DLOSERVE_CACHE/probe``; the choice is made
again from the timings each start. Delete the folder to measure again.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from service.config import EngineConfig
from service.config.offload import PROBE_SHAPE
from service.offload.mode import ProbeTimings

log = logging.getLogger("dloserve.engine")
PROBE_VERSION = 1


def cache_folder() -> Path:
    """Where the timings are kept: ``$DLOSERVE_CACHE/probe`` (the demo model's cache root)."""
    from service.models.demo import cache_dir

    return cache_dir() / "probe"


def checkpoint_digest(path: Path | dict[str, Path]) -> str:
    """sha256 over the checkpoint's safetensors headers and its folder's config.json: the
    tensors' names, dtypes, shapes and offsets, without reading a weight."""
    from service.offload.files import checkpoint_files

    h = hashlib.sha256()
    for root in sorted(path.values()) if isinstance(path, dict) else [path]:
        root = Path(root)
        config = (root if root.is_dir() else root.parent) / "config.json"
        if config.is_file():
            h.update(config.read_bytes())
        for f in checkpoint_files(root):
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                h.update(f.name.encode() + fh.read(n))
    return h.hexdigest()


def probe_facts(config: EngineConfig, accelerator: str, node_gpus: float) -> dict[str, Any]:
    """Everything the probe's timings depend on (the cache key, in the clear)."""
    import torch

    from service.models.registry import load_adapter

    adapter = load_adapter(config.model_dir, sequence_parallel=config.parallel.sp_size)
    return {"probe_version": PROBE_VERSION, "accelerator": accelerator, "node_gpus": node_gpus,
            "device": config.parallel.device, "torch": torch.__version__,
            "checkpoint": checkpoint_digest(adapter.transformer_checkpoint(adapter.experts[0])),
            "model": asdict(config.model), "probe_shape": list(config.offload.probe_shape or PROBE_SHAPE),
            "sp_size": config.parallel.sp_size}


def _key(facts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def lookup(facts: dict[str, Any]) -> tuple[ProbeTimings, str] | None:
    """The stored timings for ``facts`` and when they were measured; None on a miss (no file,
    one for other facts, or one that does not read)."""
    path = cache_folder() / f"{_key(facts)}.json"
    try:
        doc = json.loads(path.read_text())
        if doc["facts"] != json.loads(json.dumps(facts, default=str)):
            return None
        return ProbeTimings(**doc["timings"]), str(doc["measured_at"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("probe cache %s unreadable (%s): probing again", path, e)
        return None


def store(facts: dict[str, Any], timings: ProbeTimings) -> Path | None:
    """Keep ``timings`` for the next start (written whole, then renamed into place); a folder
    that cannot be written only costs the next start its probe."""
    folder = cache_folder()
    path = folder / f"{_key(facts)}.json"
    doc = {"facts": facts, "timings": asdict(timings),
           "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        tmp.replace(path)
        return path
    except OSError as e:
        log.warning("probe cache %s not written (%s)", path, e)
        return None
