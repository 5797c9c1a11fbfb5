"""DP scaling of DLO on one host: DP1 vs DP N waves, AllGather vs rank-local.

Every rank runs its own request (a full wave of N) through the same offloaded
transformer; one process per GPU, NCCL (gloo on CPU). Writes one JSON with
forwards/s, scaling efficiency against N x DP1, weight-stall share of the step,
the time of one block's AllGather, per-rank pinned bytes / PSS / device peak, and
the SHA-256 of each rank's output checked against DP1 on the same input.

    python loadtest/bench_dp.py --gpus 2 --preset wan14b-shape --layers 12
    python loadtest/bench_dp.py --device cpu --gpus 2 --preset tiny --layers 3 --tokens 64  # smoke
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from offload_strategies import meta_transformer
from ranks import run_ranks
from reporting import header, host_memory, inputs, preset_model, result_path, token_list, write_report

from service.offload import enable_layerwise_offload
from service.offload.comm import all_gather
from service.offload.mode import OffloadMode


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank(rank: int, world: int, model: str, tokens: list[int], forwards: int, allgather: bool,
          device_kind: str, refs: int) -> dict[str, Any]:
    dev = torch.device("cuda", rank) if device_kind == "cuda" else torch.device("cpu")
    folder = Path(model) / "transformer"
    text_dim = json.loads((folder / "config.json").read_text())["text_dim"]
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    module = meta_transformer(folder)
    group = dist.group.WORLD if world > 1 else None
    t0 = time.perf_counter()
    h = enable_layerwise_offload(module, folder, device=dev, group=group,
                                 mode=OffloadMode.ALLGATHER if allgather else OffloadMode.RANK_LOCAL,
                                 block_attrs=["blocks"])
    out: dict[str, Any] = {"load_s": time.perf_counter() - t0, "workloads": {}}
    for n in tokens:
        x = _seeded_inputs(n, rank, text_dim, dev, dtype)
        with torch.no_grad():
            first = module(**x, return_dict=False)[0]  # warm-up, and the output we hash
            digest = hashlib.sha256(first.float().cpu().numpy().tobytes()).hexdigest()
            ref_digests = {}
            for r in range(refs):  # DP1 only: the other ranks' inputs, for the equality check
                y = module(**_seeded_inputs(n, r, text_dim, dev, dtype), return_dict=False)[0]
                ref_digests[r] = hashlib.sha256(y.float().cpu().numpy().tobytes()).hexdigest()
            del first
            st0 = h.stats()
            if group is not None:
                dist.barrier()
            _sync(dev)
            t = time.perf_counter()
            for _ in range(forwards):
                module(**x, return_dict=False)
            _sync(dev)
            elapsed = time.perf_counter() - t
            if group is not None:
                dist.barrier()
        st1 = h.stats()
        out["workloads"][str(n)] = {
            "elapsed_s": elapsed,
            "ms_per_forward": elapsed / forwards * 1000,
            "stall_ms_per_forward": (st1.stall_s - st0.stall_s) / forwards * 1000,
            "sha256": digest,
            "ref_sha256": ref_digests,
            "device_peak_bytes": st1.device_peak_bytes,
        }
    out["gather_ms_largest_block"] = _time_gather(h, dev) if (allgather and world > 1) else None
    st = h.stats()
    out.update(host_pinned_bytes=st.host_pinned_bytes, host_shard_bytes=st.host_shard_bytes,
               pss_bytes=host_memory()["pss_bytes"], largest_block_bytes=st.largest_block_bytes)
    h.close()
    return out


def _seeded_inputs(tokens: int, seed: int, text_dim: int, dev: torch.device,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    x = inputs(tokens, text_dim, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(seed)
    x["hidden_states"] = x["hidden_states"] + 0.1 * seed * torch.randn(x["hidden_states"].shape, generator=g)
    return {k: (v.to(dev, dtype) if v.is_floating_point() else v.to(dev)) for k, v in x.items()}


def _time_gather(h: Any, dev: torch.device, reps: int = 5) -> float:
    """One largest-block AllGather on its own (not overlapped), milliseconds, median."""
    lay = max(h.layouts, key=lambda lay: lay.total_bytes)
    world = h.group.world
    shard = lay.shard_bytes(world)
    out = torch.empty(shard * world, dtype=torch.uint8, device=dev)
    inp = out.narrow(0, h.group.rank * shard, shard)
    times = []
    for _ in range(reps + 1):
        _sync(dev)
        t = time.perf_counter()
        all_gather(out, inp, group=h.group.pg)
        _sync(dev)
        times.append((time.perf_counter() - t) * 1000)
    return sorted(times[1:])[len(times[1:]) // 2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gpus", type=int, default=max(1, torch.cuda.device_count()))
    p.add_argument("--preset", default="wan14b-shape")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--model")
    p.add_argument("--tokens", type=token_list, default=[4096, 32760])
    p.add_argument("--forwards", type=int, default=4)
    p.add_argument("--out")
    args = p.parse_args(argv)
    args.model = args.model or str(preset_model(args.preset, args.layers))
    sizes = [n for n in (2, 4, 8) if n <= args.gpus]
    configs = [(1, True)] + [(n, ag) for n in sizes for ag in (True, False)]
    backend = "nccl" if args.device == "cuda" else "gloo"
    runs: dict[str, Any] = {}
    for n, ag in configs:
        name = f"dp{n}-{'allgather' if ag else 'ranklocal'}"
        t0 = time.perf_counter()
        ranks = run_ranks(_rank, n, args.model, args.tokens, args.forwards, ag, args.device,
                          max(sizes, default=1) if n == 1 else 0, timeout=900, backend=backend)
        runs[name] = {"world": n, "allgather": ag, "ranks": ranks}
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    report = {
        **header(args.device),
        "model": {"preset": args.preset, "layers": args.layers},
        "forwards_per_rank": args.forwards,
        "runs": runs,
        "summary": summarize(runs, args.tokens, args.forwards),
    }
    kind = f"h200x{args.gpus}" if "H200" in report["machine"].get("gpu", "") else f"{args.device}x{args.gpus}"
    out = Path(args.out or result_path(report, kind))
    write_report(report, out)
    print(dp_table(report))
    print(f"wrote {out}")
    return 0 if all(row["bitwise_equal_dp1"] for row in report["summary"]) else 1


def summarize(runs: dict[str, Any], tokens: list[int], forwards: int) -> list[dict[str, Any]]:
    """Per run and workload: throughput over all ranks, scaling vs N x DP1, equality."""
    rows = []
    base = runs["dp1-allgather"]["ranks"][0]["workloads"]
    for name, run in runs.items():
        for n in tokens:
            ws = [r["workloads"][str(n)] for r in run["ranks"]]
            wave_s = max(w["elapsed_s"] for w in ws)  # the wave ends with its slowest rank
            thr = run["world"] * forwards / wave_s
            base_thr = forwards / base[str(n)]["elapsed_s"]
            step_ms = wave_s / forwards * 1000
            refs = base[str(n)]["ref_sha256"]
            equal = all(w["sha256"] == refs.get(str(r), refs.get(r)) for r, w in enumerate(ws))
            rows.append({
                "run": name, "tokens": n, "world": run["world"],
                "ms_per_forward": step_ms,
                "forwards_per_s": thr,
                "scaling_efficiency": thr / (run["world"] * base_thr),
                "stall_share": max(w["stall_ms_per_forward"] for w in ws) / step_ms,
                "gather_ms_largest_block": run["ranks"][0]["gather_ms_largest_block"],
                "pinned_bytes_per_rank": run["ranks"][0]["host_pinned_bytes"],
                "pss_bytes_sum": sum(r["pss_bytes"] for r in run["ranks"]),
                "device_peak_bytes_max": max(w["device_peak_bytes"] for w in ws),
                "bitwise_equal_dp1": equal,
            })
    return rows


def dp_table(report: dict[str, Any]) -> str:
    lines = [f"{report['machine'].get('gpu', 'CPU')}, {report['model']['preset']} x "
             f"{report['model']['layers']} layers, {report['date'][:10]}", "",
             "| run | tokens | ms/forward | forwards/s | scaling vs N x DP1 | stall share "
             "| pinned GB/rank | PSS sum GB | GPU peak GB | bitwise = DP1 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["summary"]:
        lines.append(
            f"| {r['run']} | {r['tokens']:,} | {r['ms_per_forward']:.1f} | {r['forwards_per_s']:.2f} "
            f"| {r['scaling_efficiency']:.2f} | {r['stall_share']:.3f} "
            f"| {r['pinned_bytes_per_rank'] / 1e9:.2f} | {r['pss_bytes_sum'] / 1e9:.1f} "
            f"| {r['device_peak_bytes_max'] / 1e9:.1f} | {r['bitwise_equal_dp1']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
