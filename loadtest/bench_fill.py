"""Resident blocks into device memory: the one-thread host build against offload.fill.

Reads the transformer blocks of a model folder's checkpoint (mapped, as the service does;
run it twice so the files are in the page cache) and builds every block's flat buffer on the
device both ways in one process, alternating: ``host`` (a zeroed pageable host buffer, each
tensor copied in, then the whole to the device: the code before offload.fill) and ``fill``
(offload.fill.fill_blocks, N threads). Checks the buffers are equal; JSON with GB/s and the
ratio to ``loadtest/results/``.

    python loadtest/bench_fill.py /tmp/wan40 --blocks 40 --out loadtest/results/h200-fill-DATE.json
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.reporting import header, write_report  # noqa: E402
from service.offload.checkpoint import Checkpoint  # noqa: E402
from service.offload.fill import fill_blocks  # noqa: E402
from service.offload.layout import BlockLayout, plan_block  # noqa: E402

BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")


def layouts(ckpt: Checkpoint, count: int) -> list[tuple[BlockLayout, dict[str, str]]]:
    by_block: dict[int, dict[str, str]] = {}
    for key in ckpt.records:
        m = BLOCK.match(key)
        if m and int(m.group(1)) < count:
            by_block.setdefault(int(m.group(1)), {})[m.group(2)] = key
    out = []
    for i in sorted(by_block):
        keys = by_block[i]
        recs = {name: ckpt.records[k] for name, k in sorted(keys.items())}
        tensors = [(name, r.dtype, tuple(r.shape)) for name, r in recs.items()]
        out.append((plan_block(i, f"blocks.{i}", tensors), keys))
    return out


def host_build(items: list[tuple[BlockLayout, dict[str, str]]], ckpt: Checkpoint, dev: torch.device
               ) -> list[torch.Tensor]:
    out = []
    for lay, keys in items:
        host = torch.zeros(lay.total_bytes, dtype=torch.uint8)
        for e in lay.entries:
            e.view(host).copy_(ckpt.view(keys[e.name]))
        out.append(host.to(dev))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a model folder (its transformer/) or a checkpoint folder")
    p.add_argument("--blocks", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workers", type=int, default=0, help="fill's threads (0: its default)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    root = Path(args.model)
    ckpt = Checkpoint(root / "transformer" if (root / "transformer").is_dir() else root)
    items = layouts(ckpt, args.blocks)
    total = sum(lay.total_bytes for lay, _ in items)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    runs: dict[str, list[float]] = {"host": [], "fill": []}
    for _ in range(args.repeats):
        for way in ("host", "fill"):
            t0 = time.perf_counter()
            bufs = (host_build(items, ckpt, dev) if way == "host"
                    else fill_blocks(items, ckpt.view, dev, workers=args.workers or None))
            if dev.type == "cuda":
                torch.cuda.synchronize()
            runs[way].append(time.perf_counter() - t0)
            if way == "host":
                ref = bufs
            else:
                assert all(torch.equal(a, b) for a, b in zip(ref, bufs, strict=True)), "fill != host build"
            del bufs
        del ref
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    best = {k: min(v) for k, v in runs.items()}
    report: dict[str, Any] = {
        **header(),
        "blocks": len(items), "bytes": total, "device": str(dev), "threads": torch.get_num_threads(),
        "seconds": runs, "best_s": best, "gb_per_s": {k: round(total / v / 1e9, 2) for k, v in best.items()},
        "speedup_fill_over_host": round(best["host"] / best["fill"], 2), "equal": True}
    print(write_report(report, args.out).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
