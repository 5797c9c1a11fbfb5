"""Compute at the chip's limit (issue 32): the Wan2.1-14B block against its kernel floor, a
40-layer step with CFG, and what CFG in one forward does for a transfer-bound request.

Parts (``--parts``, comma-separated):

- ``block``: one ``WanTransformerBlock`` of the 14B shape (bf16, Wan's fp32 modules kept) at
  4,096 / 32,760 / 75,600 tokens: eager, compiled (torch.compile of the block class's forward,
  inductor, static shapes), compiled FP8 (service.offload.quant's ``Fp8Linear``, scaled_mm),
  each batch 1 and batch 2 (CFG in one forward), beside the kernel floor timed in the same run:
  the block's attention alone (SDPA as torch picks it, and each exact backend forced) plus its
  GEMMs alone (bf16 and FP8), ``kernel_floor_ms``, and the ratios; ``qkv_ms`` against
  ``qkv_fused_ms``: self-attention's q, k, v as three GEMMs and as one (what fusing them buys).
- ``attention`` (issue 46): the attention kernels alone at Wan's shapes, batch 1 and 2 (CFG):
  self-attention at ``--attn-tokens`` (32,760 and 75,600) and cross-attention from the first to
  512 text tokens. SDPA (cuDNN first), flash-attn-4, cuDNN's FP8 SDPA with its per-tensor
  quantization (eager: not fused as in the compiled block) and without it (the kernel alone);
  each with ms, TFLOP/s and its relative error to SDPA. A kernel that cannot run says why
  (service.models.attention_routes.available).
- ``model40``: the whole 40-layer transformer resident at 832x480x81: one CFG step as two
  batch-1 forwards and as one batch-2 forward, eager, compiled and compiled FP8 (FP8 weights),
  once per ``--attention`` setting (comma-separated: ``sdpa,exact,fp8`` gives the exact step with
  SDPA and with the measured routes, 8-bit attention, and FP8 weights + 8-bit attention).
- ``dlo``: the service's own PipelineRunner on a ``wan14b-shape`` demo checkpoint (``--model``),
  DLO DP1 (AllGather) and resident: seconds per step and requests/s at 4,096 tokens
  (1024x1024, one frame: transfer-bound) and 32,760 tokens, ``--cfg-batch`` off/on,
  ``--compile`` off/on.
- ``defaults``: the runner under default flags (DLO DP1): the attention kernel, compile and CFG
  batch it reports, and dynamo's graph count across requests (no recompile after warm-up).

    python loadtest/bench_compute.py --parts attention,model40 --attention sdpa,exact,fp8 --out $OUT/a.json
    python loadtest/bench_compute.py --parts block,model40 --out $OUT/h200-compute-block.json
    python loadtest/bench_compute.py --parts dlo --model /tmp/wan12 --out $OUT/h200-compute-dlo.json
    python loadtest/bench_compute.py --device cpu --small --parts block,model40 --out /tmp/c.json  # smoke
"""

# ruff: noqa: B023 - every timed lambda runs before its loop variables move on
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import traceback
from importlib import metadata
from typing import Any

import torch
from reporting import SHAPES, TEXT_TOKENS, Timer, header, token_list, write_report
from torch import nn

from service.config import EngineConfig, ModelConfig, OffloadConfig, OffloadMode
from service.models import attention, attention_routes, cudnn_fp8_attention, fa4_attention

WAN14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
              out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, cross_attn_norm=True,
              qk_norm="rms_norm_across_heads", eps=1e-6)
SMALL = dict(WAN14B, num_attention_heads=2, attention_head_dim=32, text_dim=64, ffn_dim=128)


def bench(fn: Any, device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median ms of ``fn()`` (CUDA events; the wall clock on CPU) after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        with Timer(device) as t:
            fn()
        out.append(t.ms)
    return round(statistics.median(out), 3)


def build(layers: int, cfg: dict[str, Any], device: torch.device) -> nn.Module:
    """A random-weight WanTransformer3DModel in bf16 with Wan's fp32 modules, on ``device``."""
    from diffusers import WanTransformer3DModel

    with torch.device(device):
        model = WanTransformer3DModel(num_layers=layers, **cfg).to(torch.bfloat16).eval()
    keep = WanTransformer3DModel._keep_in_fp32_modules or []
    for name, mod in model.named_modules():
        if any(k in name.split(".") for k in keep):
            mod.float()
    return model


def to_fp8(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose blocks' Linears are Fp8Linear (scaled_mm), weights quantized."""
    from service.offload.quant import Fp8Compute, Fp8Linear, quantize_weight, weight_scales

    out = copy.deepcopy(module)
    for block in out.blocks:
        for name, lin in [(n, m) for n, m in block.named_modules() if type(m) is nn.Linear]:
            f = Fp8Linear.like(lin, Fp8Compute.SCALED_MM if lin.weight.is_cuda else Fp8Compute.UPCAST)
            scales = weight_scales(lin.weight.float())
            f.weight = nn.Parameter(quantize_weight(lin.weight, scales), requires_grad=False)
            f.weight_scale = scales
            parent, _, leaf = name.rpartition(".")
            setattr(block.get_submodule(parent) if parent else block, leaf, f)
    return out


def latents(tokens: int, batch: int, cfg: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    f, h, w = SHAPES[tokens]
    g = torch.Generator().manual_seed(tokens)
    return {"hidden_states": torch.randn(batch, 16, f, h, w, generator=g).to(device, torch.bfloat16),
            "timestep": torch.tensor([500] * batch, device=device),
            "encoder_hidden_states": torch.randn(batch, TEXT_TOKENS, cfg["text_dim"], generator=g).to(
                device, torch.bfloat16)}


def block_args(model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple:
    """The positional inputs block 0 receives in a forward of ``model`` on ``inputs``."""
    seen: list[tuple] = []
    h = model.blocks[0].register_forward_pre_hook(lambda m, a: seen.append(a))
    with torch.no_grad():
        model(**inputs, return_dict=False)
    h.remove()
    return seen[0]


def floors(tokens: int, batch: int, cfg: dict[str, Any], device: torch.device, reps: int) -> dict[str, Any]:
    """The block's kernels alone: attention (self + cross; per exact backend) and GEMMs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from service.offload.quant import quantize_rows, quantize_weight, weight_scales

    heads, hd, ffn = cfg["num_attention_heads"], cfg["attention_head_dim"], cfg["ffn_dim"]
    dim, bf = heads * hd, torch.bfloat16
    q, k, v = (torch.randn(batch, heads, tokens, hd, device=device, dtype=bf) for _ in range(3))
    ck, cv = (torch.randn(batch, heads, TEXT_TOKENS, hd, device=device, dtype=bf) for _ in range(2))
    out: dict[str, Any] = {}
    with torch.no_grad():
        out["attention_ms"] = bench(lambda: (sdpa(q, k, v), sdpa(q, ck, cv)), device, reps)
        backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                    "efficient": SDPBackend.EFFICIENT_ATTENTION} if device.type == "cuda" else {}
        for name, be in backends.items():
            try:
                with sdpa_kernel([be]):
                    out[f"attention_{name}_ms"] = bench(lambda: (sdpa(q, k, v), sdpa(q, ck, cv)),
                                                        device, reps)
            except RuntimeError as e:
                out[f"attention_{name}_ms"] = f"not available: {str(e).splitlines()[0][:120]}"
        rows = batch * tokens
        x = torch.randn(rows, dim, device=device, dtype=bf)
        xf = torch.randn(rows, ffn, device=device, dtype=bf)
        xt = torch.randn(batch * TEXT_TOKENS, dim, device=device, dtype=bf)
        w = torch.randn(dim, dim, device=device, dtype=bf) / dim**0.5
        up = torch.randn(ffn, dim, device=device, dtype=bf) / dim**0.5
        down = torch.randn(dim, ffn, device=device, dtype=bf) / ffn**0.5
        # self q/k/v/o, cross q/o on the tokens; cross k/v on the text; the FFN's two
        gemms = [(x, w)] * 6 + [(xt, w)] * 2 + [(x, up), (xf, down)]
        flops = sum(2 * a.shape[0] * a.shape[1] * b.shape[0] for a, b in gemms)
        out["gemm_ms"] = bench(lambda: [a @ b.t() for a, b in gemms], device, reps)
        out["gemm_tflops"] = round(flops / out["gemm_ms"] / 1e9, 1)
        # self-attention's q, k, v as three GEMMs (today) and as one of 3x the width (fused)
        wqkv = torch.cat([w, w, w])
        out["qkv_ms"] = bench(lambda: [x @ w.t() for _ in range(3)], device, reps)
        out["qkv_fused_ms"] = bench(lambda: x @ wqkv.t(), device, reps)
        if device.type == "cuda":
            q8 = {id(b): (quantize_weight(b, weight_scales(b.float())), weight_scales(b.float()))
                  for _, b in gemms}

            def fp8() -> list:
                res = []
                for a, b in gemms:
                    xq, xs = quantize_rows(a)
                    wq, ws = q8[id(b)]
                    res.append(torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1),
                                                out_dtype=bf))
                return res

            out["gemm_fp8_ms"] = bench(fp8, device, reps)
            out["gemm_fp8_tflops"] = round(flops / out["gemm_fp8_ms"] / 1e9, 1)
    out["kernel_floor_ms"] = round(out["attention_ms"] + out["gemm_ms"], 3)
    if "gemm_fp8_ms" in out:
        out["kernel_floor_fp8_ms"] = round(out["attention_ms"] + out["gemm_fp8_ms"], 3)
    return out


def part_block(args: argparse.Namespace, cfg: dict[str, Any], dev: torch.device) -> dict[str, Any]:
    torch._dynamo.config.cache_size_limit = 64
    model = build(1, cfg, dev)
    fp8 = to_fp8(model)
    blk, blk8 = model.blocks[0], fp8.blocks[0]
    cls = type(blk)
    results: dict[str, Any] = {}
    for tokens in args.tokens:
        for batch in (1, 2) if tokens in args.batch2 else (1,):
            row: dict[str, Any] = {"tokens": tokens, "batch": batch}
            a = block_args(model, latents(tokens, batch, cfg, dev))
            with torch.no_grad():
                row["eager_ms"] = bench(lambda: blk(*a), dev, args.reps)
                row["eager_fp8_ms"] = bench(lambda: blk8(*a), dev, args.reps)
                comp = torch.compile(cls.forward, backend=args.backend, fullgraph=True, dynamic=False)
                t0 = time.perf_counter()
                comp(blk, *a)
                row["compile_s"] = round(time.perf_counter() - t0, 1)
                row["compiled_ms"] = bench(lambda: comp(blk, *a), dev, args.reps)
                row["compiled_fp8_ms"] = bench(lambda: comp(blk8, *a), dev, args.reps)
                ref = blk(*a).float()
                row["compiled_rel_err"] = float((comp(blk, *a).float() - ref).norm() / ref.norm())
                row["compiled_fp8_rel_err"] = float((comp(blk8, *a).float() - ref).norm() / ref.norm())
            row.update(floors(tokens, batch, cfg, dev, args.reps))
            for k in ("eager", "compiled"):
                row[f"{k}_over_floor"] = round(row[f"{k}_ms"] / row["kernel_floor_ms"], 3)
            if "kernel_floor_fp8_ms" in row:
                for k in ("eager_fp8", "compiled_fp8"):
                    row[f"{k}_over_floor"] = round(row[f"{k}_ms"] / row["kernel_floor_fp8_ms"], 3)
            print(json.dumps(row), flush=True)
            results[f"{tokens}x{batch}"] = row
            torch._dynamo.reset()
    return results


def part_model40(args: argparse.Namespace, cfg: dict[str, Any], dev: torch.device) -> dict[str, Any]:
    """One CFG step of the whole transformer at ``args.step_tokens``: 2 x batch 1 and 1 x batch 2,
    per ``--attention`` setting (its exact routes measured or cached first, as at load)."""
    model = build(args.layers, cfg, dev)
    fp8 = to_fp8(model) if dev.type == "cuda" else None  # copied before any forward is patched
    out: dict[str, Any] = {"layers": args.layers, "tokens": args.step_tokens}
    heads, hd = cfg["num_attention_heads"], cfg["attention_head_dim"]
    for setting in args.attention.split(","):
        row: dict[str, Any] = {"attention": setting}
        try:
            attention.check(setting, model, dev)
            routes = attention.load_routes(setting, model, dev, heads, hd, torch.bfloat16)
            row["routes"] = routes.as_dict()
            with attention.chosen(setting):
                out[setting] = _model40_variants(args, cfg, dev, model, fp8, row)
        except Exception as e:  # noqa: BLE001 - a setting that cannot run here says why; the others go on
            row["error"] = f"{type(e).__name__}: {e}"
            out[setting] = row
    return out


def _model40_variants(args: argparse.Namespace, cfg: dict[str, Any], dev: torch.device, model: nn.Module,
                      fp8: nn.Module | None, out: dict[str, Any]) -> dict[str, Any]:
    variants = [("eager", model, False), ("compiled", model, True)]
    if fp8 is not None:
        variants.append(("compiled_fp8", fp8, True))
    for name, m, compiled in variants:
        torch._dynamo.reset()
        for blk in m.blocks:  # the class's forward again (a previous setting compiled it)
            blk.__dict__.pop("forward", None)
        if compiled:
            fn = torch.compile(type(m.blocks[0]).forward, backend=args.backend, fullgraph=True, dynamic=False)
            for blk in m.blocks:
                blk.forward = (lambda b: lambda *a: fn(b, *a))(blk)
        for batch in (1, 2):
            inp = latents(args.step_tokens, batch, cfg, dev)
            with torch.no_grad():
                t0 = time.perf_counter()
                m(**inp, return_dict=False)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                first = time.perf_counter() - t0
                ms = bench(lambda: m(**inp, return_dict=False), dev, args.step_reps, warmup=0)
            out[f"{name}_b{batch}_forward_s"] = round(ms / 1e3, 3)
            out[f"{name}_b{batch}_first_s"] = round(first, 1)
        out[f"{name}_cfg_step_s"] = round(2 * out[f"{name}_b1_forward_s"], 3)
        out[f"{name}_cfg_batched_step_s"] = out[f"{name}_b2_forward_s"]
        mine = {k: v for k, v in out.items() if k.startswith(name)}
        print(json.dumps({"attention": out["attention"], **mine}), flush=True)
    return out


def kernels(dev: torch.device, self_attention: bool) -> dict[str, Any]:
    """The attention kernels for [B, S, H, D] q, k, v on ``dev``: a callable each, or why it
    cannot run (cuDNN FP8 and the Triton kernel serve self-attention only)."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with torch.nn.attention.sdpa_kernel(list(attention.ORDER), set_priority=True):
            return sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    out: dict[str, Any] = {"sdpa": exact}
    why = attention_routes.available("fa4", dev)
    out["fa4"] = why or fa4_attention.attend
    why = attention_routes.available("cudnn_fp8", dev) or (None if self_attention else "self-attention only")
    out["cudnn_fp8"] = why or cudnn_fp8_attention.attend
    if not isinstance(out["cudnn_fp8"], str):
        def kernel_only(q8: tuple, k8: tuple, v8: tuple) -> torch.Tensor:  # quantized before timing
            s = cudnn_fp8_attention.scales(q8[1], k8[1], v8[1])
            return cudnn_fp8_attention._kernel(q8[0], k8[0], v8[0], *s.graph_inputs())

        out["cudnn_fp8_kernel_only"] = kernel_only
    return out


def part_attention(args: argparse.Namespace, cfg: dict[str, Any], dev: torch.device) -> dict[str, Any]:
    """Each attention kernel alone at Wan's shapes: ms, TFLOP/s, relative error to SDPA."""
    heads, hd = cfg["num_attention_heads"], cfg["attention_head_dim"]
    calls = [("self", t, t) for t in args.attn_tokens] + [("cross", args.attn_tokens[0], TEXT_TOKENS)]
    results: dict[str, Any] = {}
    for kind, sq, skv in calls:
        for batch in (1, 2):
            g = torch.Generator(device=dev).manual_seed(sq)
            q = torch.randn(batch, sq, heads, hd, device=dev, dtype=torch.bfloat16, generator=g)
            k, v = (torch.randn(batch, skv, heads, hd, device=dev, dtype=torch.bfloat16, generator=g)
                    for _ in range(2))
            flops = 4 * batch * heads * sq * skv * hd
            row: dict[str, Any] = {"kind": kind, "batch": batch, "q_tokens": sq, "kv_tokens": skv}
            with torch.inference_mode():
                ref = None
                for name, fn in kernels(dev, kind == "self").items():
                    if isinstance(fn, str):
                        row[name] = f"not available: {fn}"
                        continue
                    try:
                        alone = name == "cudnn_fp8_kernel_only"
                        args_ = tuple(map(cudnn_fp8_attention.quantize, (q, k, v))) if alone else (q, k, v)
                        got = fn(*args_)
                        if alone:  # O's descale is V's
                            got = got.float() * args_[2][1]
                        ms = bench(lambda: fn(*args_), dev, args.reps)
                        got = got.float()
                        ref = got if ref is None else ref
                        row[name] = {"ms": ms, "tflops": round(flops / ms / 1e9, 1),
                                     "rel_err_to_sdpa": round(float((got - ref).norm() / ref.norm()), 5)}
                    except Exception as e:  # noqa: BLE001 - record it; the other kernels go on
                        row[name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
            base = row["sdpa"]["ms"]
            for name, r in row.items():
                if isinstance(r, dict) and name != "sdpa":
                    r["speedup_vs_sdpa"] = round(base / r["ms"], 3)
            print(json.dumps(row), flush=True)
            results[f"{kind}:{batch}x{sq}->{skv}"] = row
    return results


def versions() -> dict[str, Any]:
    """The attention wheels' versions (None: not installed) and cuDNN's, for the result's machine."""
    cudnn = torch.backends.cudnn
    out: dict[str, Any] = {"cudnn": cudnn.version() if cudnn.is_available() else None}
    for dist in ("flash-attn-4", "nvidia-cudnn-frontend", "nvidia-cutlass-dsl"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def part_dlo(args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    """The service's runner: seconds per step and requests/s, DLO DP1 and resident."""
    from service.models.pipeline import PipelineRunner
    from service.models.request import GenerationRequest

    sizes = {4096: (1024, 1024, 1), 32760: (480, 832, 81)}
    out: dict[str, Any] = {"model": args.model, "layers": None}
    for run in args.dlo_runs:
        mode, cfgb, comp, tokens = run.split(":")
        h, w, f = sizes[int(tokens)]
        probe = (h, w, f) if mode != "resident" else None
        settings = EngineConfig(offload=OffloadConfig(OffloadMode(mode), probe_shape=probe),
                                model=ModelConfig(cfg_batch=cfgb, compile=comp, attention=args.attention))
        t0 = time.perf_counter()
        runner = PipelineRunner.load(args.model, dev, config=settings)
        load_s = time.perf_counter() - t0
        try:
            req = GenerationRequest(prompt="a red fox running through snow", seed=1, height=h, width=w,
                                    num_frames=f, num_inference_steps=args.dlo_steps, guidance_scale=5.0)
            steps: list[float] = []
            last = [0.0]

            def on_step(i: int, n: int) -> None:
                now = time.perf_counter()
                steps.append(now - last[0])
                last[0] = now

            walls = []
            for _rep in range(args.dlo_reps + 1):  # the first is a warm-up (and the compile's new shape)
                steps.clear()
                last[0] = t1 = time.perf_counter()
                runner.frames(req, on_step)
                walls.append(time.perf_counter() - t1)
            row = {"load_s": round(load_s, 1), "load_stages": runner.load_stages,
                   "forwards": runner.adapter.forwards(req),
                   "step_s": round(statistics.median(steps[1:] or steps), 3),
                   "request_s": round(statistics.median(walls[1:]), 3),
                   "requests_per_s": round(1 / statistics.median(walls[1:]), 4),
                   "first_request_s": round(walls[0], 1), "describe": runner.describe().get("compile")}
            stats = runner.offload_stats()
            if stats:
                row["stall_s_per_forward"] = stats.get("stall_s_per_forward", stats.get("stall_s"))
            out["layers"] = len(runner.transformer.blocks)
        finally:
            runner.close()
        print(json.dumps({run: row}), flush=True)
        out[run] = row
    return out


def part_defaults(args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    """The runner under default flags (DLO AllGather DP1; --compile and --cfg-batch auto): what
    it reports (attention kernel, compile, CFG batch, load stages) and dynamo's graph count
    before and after requests of one size through both slots (none new expected)."""
    from torch._dynamo.utils import counters

    from service.models.pipeline import PipelineRunner
    from service.models.request import GenerationRequest

    settings = EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER, probe_shape=(1024, 1024, 1)))
    runner = PipelineRunner.load(args.model, dev, config=settings)
    try:
        warm = int(counters["stats"]["unique_graphs"])
        for seed in range(3):
            runner.frames(GenerationRequest(prompt="a fox", seed=seed, height=1024, width=1024, num_frames=1,
                                            num_inference_steps=3))
        d = runner.describe()
        return {"attention": d["attention"], "compile": d["compile"], "cfg_batch": d["cfg_batch"],
                "load_stages": runner.load_stages, "graphs_after_warmup": warm,
                "graphs_after_3_requests": int(counters["stats"]["unique_graphs"]),
                "forwards": runner.offload_stats()["forwards"]}
    finally:
        runner.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="block,model40")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny dims (a CPU smoke run)")
    p.add_argument("--tokens", type=token_list, default="4096,32760,75600")
    p.add_argument("--batch2", default="32760", help="token counts also timed at batch 2 (CFG batched)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--attention", default="exact", help="model40: --attention settings, comma-separated "
                   "(exact, sdpa, fa4, fp8); dlo: one of them")
    p.add_argument("--attn-tokens", default="32760,75600", help="attention: the self-attention token counts")
    p.add_argument("--step-tokens", type=int, default=32760)
    p.add_argument("--step-reps", type=int, default=2)
    p.add_argument("--model", default="/tmp/wan12")
    p.add_argument("--dlo-runs", default="allgather:off:off:4096,allgather:on:off:4096,allgather:off:on:4096,"
                   "allgather:on:on:4096,resident:on:on:4096,allgather:on:on:32760,resident:on:on:32760")
    p.add_argument("--dlo-steps", type=int, default=4)
    p.add_argument("--dlo-reps", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    args.batch2 = [int(t) for t in args.batch2.split(",") if t]
    args.dlo_runs = args.dlo_runs.split(",")
    args.attn_tokens = [int(t) for t in args.attn_tokens.split(",")]
    dev = torch.device(args.device)
    cfg = SMALL if args.small else WAN14B
    result: dict[str, Any] = {**header(args.device, **versions()),
                              "config": {k: v for k, v in cfg.items() if k != "patch_size"}}
    for part in args.parts.split(","):
        t0 = time.perf_counter()
        try:
            if part == "block":
                result[part] = part_block(args, cfg, dev)
            elif part == "attention":
                result[part] = part_attention(args, cfg, dev)
            elif part == "model40":
                result[part] = part_model40(args, cfg, dev)
            elif part == "dlo":
                result[part] = part_dlo(args, dev)
            elif part == "defaults":
                result[part] = part_defaults(args, dev)
        except Exception as e:  # noqa: BLE001 - keep the other parts' figures
            traceback.print_exc()
            result[part + "_error"] = f"{type(e).__name__}: {e}"
        result[part + "_wall_s"] = round(time.perf_counter() - t0, 1)
        write_report(result, args.out)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps({k: v for k, v in result.items() if k.endswith("_wall_s") or k.endswith("_error")}))


if __name__ == "__main__":
    main()
