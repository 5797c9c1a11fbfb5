"""Issue 46's GPU paths, checked on the H200 (first run 2026-12-05: loadtest/results/h200-attention-check-*).

1. Which kernels run here and why not (service.models.attention_routes.available), and the
   wheels' versions (``pip install -e '.[gpu]'``, requirements-gpu.lock).
2. Each kernel alone at Wan's shapes (CFG batch 2; self-attention at 32,760 and 75,600 tokens,
   cross-attention to 512 text tokens), against SDPA: relative error and ms. cuDNN's FP8 is
   also compared with its recipe in fp32 torch (``cudnn_fp8_attention.emulate``): a kernel
   fault shows as a gap between the two, the FP8 recipe's own error as their agreement.
3. The exact routes the service would load (measured now, or from the cache).
4. One 40-layer forward (832x480x81, batch 2, compiled) under ``sdpa`` (the reference),
   ``exact`` (the routes), ``fp8`` and FP8 weights + ``fp8``, compiled as the service compiles
   (q, k, v as one GEMM; the FFN's GELU in its GEMM's epilogue, not with FP8 weights), and without
   those fusions (``*_unfused``): relative error and PSNR of the output against the reference's,
   and seconds per forward;
   ``--profile``: each setting's GPU time per forward by kernel (the top ones) and by kind
   (GEMM, attention, inductor's generated kernels, the rest).

Exit 1 where a check fails: exact kernels within ``EXACT_ERR`` of SDPA; cuDNN FP8 within
``FP8_ERR`` of SDPA and ``RECIPE_GAP`` of its recipe; the exact step's PSNR >= ``EXACT_PSNR``.

    python loadtest/gpu_check_attention.py --out loadtest/results/h200-attention-check-DATE.json
    python loadtest/gpu_check_attention.py --device cpu --small --layers 1 --tokens 4096 --step-tokens 64 \
        --reps 2 --out /tmp/c.json  # smoke: SDPA only, the rest "not available" with why
"""

# ruff: noqa: B023 - every timed lambda runs before its loop variables move on
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compute import SMALL, WAN14B, bench, build, kernels, latents, to_fp8, versions  # noqa: E402
from reporting import TEXT_TOKENS, header, write_report  # noqa: E402

from service.models import attention, attention_routes, compiled, cudnn_fp8_attention, fused_gemms  # noqa: E402

EXACT_ERR = 0.01  # fa4 measured 0.0023 relative to cuDNN (issue 46)
FP8_ERR = 0.1  # cuDNN FP8 at scale_s 448 measured 0.06 (random inputs)
RECIPE_GAP = 0.05  # kernel against its fp32 recipe: 0.040-0.042 on the H200 (2026-12-05) at 32,760 and 75,600
# tokens, steady across sizes (a fault would not be): the recipe differs from cuDNN's in a detail not yet
# found (the row sum's precision, say); the kernel's own error to SDPA, 0.060, is issue 46's measurement
EXACT_PSNR = 40.0  # dB: a 40-layer exact forward through another exact kernel


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def psnr(a: torch.Tensor, ref: torch.Tensor) -> float:
    """dB of ``a`` against ``ref``, the peak being ref's largest magnitude."""
    mse = float(((a.float() - ref.float()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(float(ref.float().abs().max()) ** 2 / mse)


def check_kernels(cfg: dict[str, Any], dev: torch.device, tokens: list[int], reps: int,
                  fails: list[str]) -> dict[str, Any]:
    heads, hd = cfg["num_attention_heads"], cfg["attention_head_dim"]
    out: dict[str, Any] = {}
    for kind, sq, skv in [("self", t, t) for t in tokens] + [("cross", tokens[0], TEXT_TOKENS)]:
        g = torch.Generator(device=dev).manual_seed(sq)
        q = torch.randn(2, sq, heads, hd, device=dev, dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(2, skv, heads, hd, device=dev, dtype=torch.bfloat16, generator=g)
                for _ in range(2))
        row: dict[str, Any] = {}
        with torch.inference_mode():
            calls = kernels(dev, kind == "self")
            exact = calls.pop("sdpa")
            ref = exact(q, k, v)
            row["sdpa_ms"] = bench(lambda: exact(q, k, v), dev, reps)
            for name, fn in calls.items():
                if isinstance(fn, str) or name == "cudnn_fp8_kernel_only":
                    row[name] = fn if isinstance(fn, str) else "timed in bench_compute.py --parts attention"
                    continue
                try:
                    got = fn(q, k, v)
                    r = {"rel_err": round(_rel(got, ref), 5), "ms": bench(lambda: fn(q, k, v), dev, reps)}
                    if name == "cudnn_fp8":
                        q8, k8, v8 = (cudnn_fp8_attention.quantize(x) for x in (q, k, v))
                        s = cudnn_fp8_attention.scales(q8[1], k8[1], v8[1])
                        rows = 1024  # the recipe's fp32 scores: [1, H, rows, S] (a query row needs no other)
                        recipe = cudnn_fp8_attention.emulate(q8[0][:1, :rows], k8[0][:1], v8[0][:1], s)
                        r["rel_err_to_recipe"] = round(_rel(got[:1, :rows], recipe.float() * s.descale_o), 5)
                        if r["rel_err_to_recipe"] > RECIPE_GAP:
                            fails.append(f"cudnn_fp8 {kind} {sq}: {r['rel_err_to_recipe']} from its recipe")
                    bound = EXACT_ERR if name == "fa4" else FP8_ERR
                    if r["rel_err"] > bound:
                        fails.append(f"{name} {kind} {sq}: error {r['rel_err']} > {bound}")
                    row[name] = r
                except Exception as e:  # noqa: BLE001 - a failing kernel is a finding
                    row[name] = f"failed: {type(e).__name__}: {str(e)[:300]}"
                    fails.append(f"{name} {kind} {sq}: {row[name]}")
        print(json.dumps({f"{kind}:{sq}->{skv}": row}), flush=True)
        out[f"{kind}:2x{sq}->{skv}"] = row
    return out


# name -> (--attention, FP8 weights, "unfused": q, k, v as diffusers' three GEMMs and the GELU apart
# (service.models.fused_gemms) instead of the service's fusions). The tuning and fusion experiments
# (exact_nogelu, *_cdt, *_nocdt, exact_autotune): git show 728f0a4 (docs/benchmarks.md, "Removed experiments")
STEP_SETTINGS = {"exact_sdpa": ("sdpa", False, False), "exact_routes": ("exact", False, False),
                 "exact_unfused": ("exact", False, True), "attn_fp8": ("fp8", False, False),
                 "fp8_weights_attn_fp8": ("fp8", True, False),
                 "fp8_weights_attn_fp8_unfused": ("fp8", True, True)}
KINDS = (("attention", ("attention", "flash", "fmha", "sdpa")),
         ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas")), ("generated", ("triton",)))


def kernel_table(run: Any, top: int = 12) -> dict[str, Any]:
    """GPU ms of one ``run()`` by kernel (the ``top`` longest) and by kind (a name's first match
    in ``KINDS``; fa4's CuTe kernel names attention before cutlass)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    rows = sorted(((e.key, e.self_device_time_total / 1e3, e.count) for e in prof.key_averages()
                   if e.self_device_time_total > 0), key=lambda r: -r[1])
    kinds: dict[str, float] = {}
    for name, ms, _ in rows:
        kind = next((k for k, marks in KINDS if any(m in name.lower() for m in marks)), "other")
        kinds[kind] = round(kinds.get(kind, 0.0) + ms, 1)
    return {"total_ms": round(sum(r[1] for r in rows), 1), "by_kind_ms": kinds,
            "top": [{"kernel": n[:120], "ms": round(ms, 1), "calls": c} for n, ms, c in rows[:top]]}


def check_step(cfg: dict[str, Any], dev: torch.device, layers: int, tokens: int, names: list[str],
               ref_path: Path | None, fails: list[str], profile: bool = False) -> dict[str, Any]:
    """One compiled 40-layer CFG forward per setting, against the sdpa one (``ref_path``: where
    the sdpa output is kept, so a later call can compare its settings without recomputing it;
    the weights come from one seed, so the same model is built again)."""
    torch.manual_seed(0)
    model = build(layers, cfg, dev)
    fp8 = to_fp8(model) if dev.type == "cuda" and any(STEP_SETTINGS[n][1] for n in names) else None
    inp = latents(tokens, 2, cfg, dev)
    heads, hd = cfg["num_attention_heads"], cfg["attention_head_dim"]
    out: dict[str, Any] = {}
    ref = torch.load(ref_path, map_location=dev) if ref_path and ref_path.is_file() else None
    for name in names:
        setting, fp8_weights, unfused = STEP_SETTINGS[name]
        m = fp8 if fp8_weights else model
        if m is None:
            out[name] = "FP8 weights need CUDA (scaled_mm)"
            continue
        try:
            attention.check(setting, m, dev)
            routes = attention.load_routes(setting, m, dev, heads, hd, torch.bfloat16)
            torch._dynamo.reset()
            for blk in m.blocks:
                blk.__dict__.pop("forward", None)
            quantization = "fp8" if fp8_weights else None
            fn = torch.compile(type(m.blocks[0]).forward, fullgraph=True, dynamic=False,
                               options=compiled.options_for("inductor", quantization))
            for blk in m.blocks:
                blk.forward = (lambda b: lambda *a: fn(b, *a))(blk)
            with attention.chosen(setting, frozenset() if unfused else fused_gemms.FUSIONS), torch.no_grad():
                t0 = time.perf_counter()
                got = m(**inp, return_dict=False)[0]
                first = time.perf_counter() - t0
                ms = bench(lambda: m(**inp, return_dict=False), dev, 2, warmup=0)
                on_gpu = profile and dev.type == "cuda"
                kernels_ms = kernel_table(lambda: m(**inp, return_dict=False)) if on_gpu else None
            if ref is None:
                ref = got
                if ref_path:
                    torch.save(got, ref_path)
            db = round(psnr(got, ref), 2) if got is not ref else "reference"
            r = {"forward_s": round(ms / 1e3, 3), "first_s": round(first, 1),
                 "rel_err": round(_rel(got, ref), 5), "psnr_db": db, "routes": routes.as_dict()}
            if kernels_ms:
                r["kernels"] = kernels_ms
            if setting == "exact" and isinstance(db, float) and db < EXACT_PSNR:
                fails.append(f"{name}: PSNR {r['psnr_db']} dB < {EXACT_PSNR}")
            out[name] = r
        except Exception as e:  # noqa: BLE001
            out[name] = f"failed: {type(e).__name__}: {str(e)[:300]}"
            if setting != "fp8" or dev.type == "cuda":
                fails.append(f"{name}: {out[name]}")
        print(json.dumps({name: out[name]}), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny dims (a CPU smoke run)")
    p.add_argument("--tokens", default="32760,75600", help="self-attention token counts")
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--step-tokens", type=int, default=32760)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--parts", default="kernels,routes,step", help="of kernels, routes, step")
    p.add_argument("--settings", default=",".join(STEP_SETTINGS), help=f"step: of {list(STEP_SETTINGS)}; "
                   "the first is the reference unless --ref holds one")
    p.add_argument("--ref", type=Path, default=None, help="step: the reference output's file (kept, reused)")
    p.add_argument("--profile", action="store_true", help="step: each setting's GPU time by kernel")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    cfg = SMALL if a.small else WAN14B
    tokens = [int(t) for t in a.tokens.split(",")]
    fails: list[str] = []
    report: dict[str, Any] = {**header(a.device, **versions()),
                              "available": {k: attention_routes.available(k, dev) or "runs"
                                            for k in attention_routes.KERNELS}}
    parts = a.parts.split(",")
    if "kernels" in parts:
        report["kernels"] = check_kernels(cfg, dev, tokens, a.reps, fails)
    if "routes" in parts and dev.type == "cuda" and report["available"]["fa4"] == "runs":
        heads, hd = cfg["num_attention_heads"], cfg["attention_head_dim"]
        report["routes"] = attention_routes.measured_routes(heads, hd, torch.bfloat16, dev).as_dict()
        print(json.dumps({"routes": report["routes"]}), flush=True)
    if "step" in parts:
        report["step"] = check_step(cfg, dev, a.layers, a.step_tokens, a.settings.split(","), a.ref, fails,
                                    a.profile)
    report["fails"] = fails
    print("wrote", write_report(report, a.out))
    for f in fails:
        print("FAILED:", f)
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
