"""A LoRA on every Linear against none: transformer time per forward, resident and streamed.

One GPU, the Wan2.1-14B block shapes (``dloserve demo-model --preset wan14b-shape``), a
rank-``--rank`` adapter (default 64) on every Linear of the transformer written in diffusers'
PEFT layout by ``service.models.demo.lora``, read and checked by ``service.models.lora`` and
applied as dloserve's side branches (``service.offload.lora``). Per strategy (resident, DLO
AllGather DP1): the median forward without the adapter, with it, and without it again (the
hooks are gone and the base weights untouched: the output's SHA-256 equals the first run's),
the ratio (issue 24's target: <= 1.05), the device memory the adapter takes (allocator delta
and the factors' bytes) and the device peak. A denoising step is one forward, or two under
CFG: the ratio is the same per step.

    python loadtest/bench_lora.py --layers 40 --out $OUT/h200-lora.json        # H200, ~10 min
    python loadtest/bench_lora.py --smoke                                      # CPU, tiny model
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from offload_strategies import keep_fp32, meta_transformer
from reporting import Timer, header, inputs, machine_kind, preset_model, result_path, token_list, write_report

STRATEGIES = ("resident", "dlo")
TARGET = 1.05


def _timed(module: torch.nn.Module, x: dict[str, Any], dev: torch.device, warmup: int, reps: int
           ) -> tuple[list[float], str]:
    times, digest = [], ""
    with torch.inference_mode():
        for i in range(warmup + reps):
            with Timer(dev) as t:
                y = module(**x, return_dict=False)[0]
            if i == 0:
                digest = hashlib.sha256(y.float().cpu().numpy().tobytes()).hexdigest()
            if i >= warmup:
                times.append(t.ms)
            del y
    return times, digest


def run_strategy(args: argparse.Namespace, strategy: str, lora_path: Path) -> dict[str, Any]:
    from service.models.lora import RankAdapters
    from service.models.lora_ref import LoraRef
    from service.offload import OffloadMode, enable_layerwise_offload, load_resident

    dev = torch.device(args.device)
    folder = Path(args.model) / "transformer"
    dtype = getattr(torch, args.dtype) if args.dtype else None
    keep = keep_fp32() if dtype is not None else ()
    module, handle = meta_transformer(folder), None
    t0 = time.perf_counter()
    if strategy == "resident":
        load_resident(module, folder, dev, dtype=dtype, keep_fp32=keep, block_attrs=["blocks"])
    else:
        handle = enable_layerwise_offload(module, folder, device=dev, block_attrs=["blocks"], dtype=dtype,
                                          mode=OffloadMode.ALLGATHER, keep_fp32=keep)
    res: dict[str, Any] = {"load_s": time.perf_counter() - t0, "tokens": {}}
    adapters = RankAdapters(module, "wan-t2v", "WanPipeline", dev, int(args.cache_gb * 2**30))
    ref = (LoraRef("bench", 1.0, source=str(lora_path)),)
    text_dim = json.loads((folder / "config.json").read_text())["text_dim"]
    x_dtype = module.patch_embedding.weight.dtype
    for tokens in args.tokens:
        x = inputs(tokens, text_dim, dev, x_dtype)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        base, sha0 = _timed(module, x, dev, args.warmup, args.reps)
        peak0 = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
        before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        t1 = time.perf_counter()
        with adapters.applied(ref):
            load_s = time.perf_counter() - t1  # 0 after the first workload: the LRU holds it
            after = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            lora, sha1 = _timed(module, x, dev, args.warmup, args.reps)
            peak1 = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
        again, sha2 = _timed(module, x, dev, 0, 1)
        m0, m1 = statistics.median(base), statistics.median(lora)
        res["tokens"][str(tokens)] = {
            "median_ms": m0, "lora_median_ms": m1, "ratio": m1 / m0, "meets_target": m1 / m0 <= TARGET,
            "times_ms": base, "lora_times_ms": lora, "after_ms": again,
            "adapter_load_s": load_s, "device_delta_bytes": after - before if dev.type == "cuda" else None,
            "device_peak_bytes": peak0, "lora_device_peak_bytes": peak1,
            "sha256": sha0, "lora_sha256": sha1, "lora_changes_output": sha1 != sha0,
            "unchanged_after": sha2 == sha0,
        }
        print(f"{strategy} {tokens} tokens: {m0:.1f} ms -> {m1:.1f} ms with the adapter ({m1 / m0:.3f}x)",
              flush=True)
    res["adapter"] = adapters.stats()
    res["adapter"]["factor_bytes"] = res["adapter"]["used_bytes"]
    if handle is not None:
        res["offload_stats"] = handle.stats().as_dict()
        handle.close()
    del module, adapters
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default="wan14b-shape")
    p.add_argument("--layers", type=int, default=40, help="transformer blocks (40: the real Wan2.1-14B)")
    p.add_argument("--model", help="a Wan pipeline folder; default: write the preset to a temp dir (reused)")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--tokens", type=token_list, default=[4096, 32760])
    p.add_argument("--strategies", type=lambda s: s.split(","), default=list(STRATEGIES))
    p.add_argument("--dtype", default=None, help="cast at load (e.g. bfloat16 for the fp32 CPU presets)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--cache-gb", type=float, default=4.0, help="the adapter LRU's budget (--lora-cache-gb)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny preset, 3 layers, 64 tokens, rank 4")
    p.add_argument("--out", help="JSON path; default <kind>-lora-<date>.json in $OUT, else "
                                 "loadtest/results/")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.preset, args.layers, args.tokens = "cpu", "tiny", 3, [64]
        args.rank, args.reps, args.warmup = 4, 1, 0
    from service.models.demo.lora import write_demo_lora

    t_start = time.perf_counter()
    tmp = Path(tempfile.gettempdir())
    args.model = args.model or str(preset_model(args.preset, args.layers, args.device))
    cfg = json.loads((Path(args.model) / "transformer" / "config.json").read_text())
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device == "cuda" else
                                                           torch.float32)
    lora = tmp / f"dloserve-bench-lora-{Path(args.model).name}-r{args.rank}.safetensors"
    if not lora.is_file():
        write_demo_lora(args.model, lora, rank=args.rank, dtype=dtype, device=args.device, strength=0.05)
    report: dict[str, Any] = {
        **header(args.device),
        "model": {"preset": args.preset, "layers": args.layers, "dim": cfg["num_attention_heads"] *
                  cfg["attention_head_dim"], "path": args.model},
        "adapter": {"rank": args.rank, "file_bytes": lora.stat().st_size, "path": str(lora)},
        "target_ratio": TARGET, "strategies": {}}
    for s in args.strategies:
        report["strategies"][s] = run_strategy(args, s, lora)
    report["seconds"] = time.perf_counter() - t_start
    out = Path(args.out or result_path(report, machine_kind(report, args.device), "lora"))
    write_report(report, out)
    for s, r in report["strategies"].items():
        for t, w in r["tokens"].items():
            print(f"{s:9s} {t:>6s} tokens  {w['median_ms']:9.1f} ms  {w['lora_median_ms']:9.1f} ms  "
                  f"{w['ratio']:.3f}x  adapter {r['adapter']['factor_bytes'] / 2**20:.0f} MiB  "
                  f"unchanged after: {w['unchanged_after']}")
    print(f"wrote {out} ({report['seconds']:.0f} s)")
    ok = all(w["unchanged_after"] and w["lora_changes_output"]
             for r in report["strategies"].values() for w in r["tokens"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
