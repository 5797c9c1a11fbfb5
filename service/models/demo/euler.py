"""A view of a Wan pipeline folder with a flow-matching Euler scheduler instead of its own
(Wan2.1's published UniPC): the scheduler whose kept state is the latents alone
(models/loop.py), for the tests and the benchmarks that compare it with UniPC on a demo (or
any local) model (``loadtest/bench_startup.py --euler``). The other
components are symlinks to the source folder's files, nothing is copied.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

DEFAULT_SHIFT = 3.0  # Wan2.1 at 480p


def euler_view(src: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write ``out``: ``src``'s components linked, its scheduler replaced by
    ``FlowMatchEulerDiscreteScheduler`` with ``src``'s flow shift (3.0 if it states none)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    src, out = Path(src).resolve(), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for part in src.iterdir():
        if part.name not in ("scheduler", "model_index.json") and not (out / part.name).exists():
            (out / part.name).symlink_to(part)
    index = json.loads((src / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    (out / "model_index.json").write_text(json.dumps(index))
    config = src / "scheduler" / "scheduler_config.json"
    shift = json.loads(config.read_text()).get("flow_shift") if config.exists() else None
    FlowMatchEulerDiscreteScheduler(shift=shift or DEFAULT_SHIFT).save_config(out / "scheduler")
    return out
