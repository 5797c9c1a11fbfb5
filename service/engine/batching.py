"""Which requests share a forward (the batch key) and how many (the cap): the one place.

Why batch at all: under DLO every forward streams every block, whatever its batch. A Wan-14B
block is 703 MB, 12.8 ms over PCIe at 55 GB/s, while its compute at 4,096 tokens is 4.4 ms:
the GPU waits for the bus two thirds of each forward. B requests in one forward stream each
block once for all of them, so while transfer binds the extra rows are free; once B rows'
compute covers the transfer, more rows only lengthen the forward. Hence the cap:
``ceil(transfer per block / compute per block of one request)``, at least 1 (compute binds:
no batching, as for 480p x 81 frames) and at most ``AUTO_CEILING``.

The figures come from the load-time probe (``ModeChoice``: the predicted transfer per block
of the chosen mode, one block's compute at the probe shape, scaled to the request's tokens).
Where no probe ran (CPU ranks by rule, resident weights, flags that set the mode) "auto" is 1:
nothing measured says transfer binds. ``--max-batch-size N`` sets the cap outright.

The key: requests whose forwards can be one call. Same latent shape (their rows are
concatenated), CFG on or off (the calls per step), the text length (the text rows), the
LoRA set (applied once per forward), no step cache (its state and its skip decisions are per
branch of one request), no image (conditioning inputs of their own), one expert, no sequence
parallelism. Seeds, step counts, schedulers, flow shifts and guidance values may differ: each
request runs its own loop, only the transformer calls meet. A request without a key (None)
runs alone, exactly as before.
"""

from __future__ import annotations

import json
import math
from typing import Any

from service.config import EngineConfig, OffloadMode
from service.config.offload import PROBE_SHAPE

AUTO_CEILING = 8  # "auto" never batches more: the latency of a forward grows with its rows
DEFAULT_TEXT = 512  # Wan's max_sequence_length default (text rows per request)


def batch_key(req: Any, config: EngineConfig) -> str | None:
    """Canonical JSON of what requests sharing a forward must agree on; None: runs alone."""
    cache = req.cache if req.cache is not None else config.step_cache
    if (req.image is not None or (cache is not None and cache.enabled) or config.parallel.sp_size > 1
            or req.extra.get("guidance_scale_2") is not None):
        return None
    key = {"height": req.height, "width": req.width, "num_frames": req.num_frames, "cfg": req.cfg,
           "text": req.extra.get("max_sequence_length", DEFAULT_TEXT),
           "loras": [[r.name, float(r.scale), r.expert, r.sha256] for r in req.loras]}
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def transfer_cap(transfer_s: float, compute_s: float, ceiling: int = AUTO_CEILING) -> int:
    """Requests per forward while transfer binds: ceil(transfer / one request's compute)."""
    if not compute_s > 0 or not transfer_s > 0:
        return 1
    return max(1, min(ceiling, math.ceil(transfer_s / compute_s)))


def batch_cap(req: Any, config: EngineConfig) -> int:
    """How many requests of ``req``'s key may share a forward on one rank."""
    setting = config.scheduler.max_batch_size
    if setting == 1 or config.scheduler.scheduler != "continuous" or batch_key(req, config) is None:
        return 1
    if setting != "auto":
        return int(setting)
    choice = config.choice
    timings = choice.timings if choice is not None else None
    if timings is None or not config.offload.enabled:
        return 1
    transfer = choice.allgather_s if choice.mode is OffloadMode.ALLGATHER else choice.ranklocal_s
    height, width, frames = config.offload.probe_shape or PROBE_SHAPE
    def size(h: int, w: int, f: int) -> int:  # pixels x latent frames: tokens up to a constant
        return h * w * ((f - 1) // 4 + 1)

    share = size(req.height, req.width, req.num_frames) / size(height, width, frames)
    return transfer_cap(transfer or 0.0, timings.compute_s * share)
