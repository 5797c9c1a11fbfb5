"""Issue 22 benchmark: two experts (Wan2.2 A14B) streamed through one ring, against both resident.

Each run loads the pipeline's two transformers (``transformer`` and ``transformer_2``, one
``Experts`` module, one checkpoint mapping: dloserve's own loading path) in fresh processes
and runs one request's transformer forwards (``--steps`` steps, CFG: two forwards a step,
the expert of each from the scheduler and ``boundary_ratio``, as the pipeline does) at each
``--sizes`` size. Per forward: time (CUDA events; the wall clock on CPU), stall (what compute
waited for weights), H2D bytes, the expert; per expert the output's SHA-256 (every forward
gets the same inputs, so each expert's output must equal the resident run's, bit for bit).

Runs (``--runs``):

- ``resident``: both experts on the device (DP1): the time to beat, and its device peak.
- ``dp1``: DLO on one rank; the ring is told the next forward's expert (``expect``), so the
  first block of the next expert is prefetched during the last block of this one.
- ``dp1-noexpect``: the same without ``expect``: the ring keeps prefetching expert 0's first
  block after every forward, so each forward of expert 1 (the switch first) drops that fill
  and waits for a fresh one: what a switch costs without the prefetch, the stall that
  ``dp1`` must not have.
- ``dp2-allgather``: DLO AllGather on two ranks in step (same request progress).
- ``dp2-offset``: AllGather, rank 1 ``--offset`` forwards ahead (the tail of one request,
  then the next one's start): ticks where the ranks need different experts run one expert
  (the majority; ties to expert 0) and the other rank replays the gathers and holds its
  forward, as engine.experts does. Its cost is the extra ticks (``ticks`` vs forwards).
- ``dp2-ranklocal``: two rank-local ranks, each streams whole blocks from the page cache,
  no lock-step (rank 1 offset the same way).

Summary per run and size: median ms per forward (switch forwards apart), the switch
forwards' ms and stall against the others', device peak, host PSS summed over the ranks
against the target 1.05 x checkpoint + 1.5 GB per rank, prefetch redirects, and bitwise
equality with ``resident``.

    # a GPU host (nvidia-h200-x2), Wan2.2-A14B full shape (2 x 40 layers, ~57 GB bf16):
    python loadtest/bench_experts.py --device cuda --preset wan22-a14b-shape --layers 40 \\
        --sizes 1280x720x81,832x480x33 --steps 4 --out loadtest/results/h200x2-experts-DATE.json
    # CPU smoke (tiny model, gloo ranks; a minute or two):
    python loadtest/bench_experts.py --smoke --out /tmp/experts-smoke.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from reporting import Timer, header, host_memory

from service.config.offload import parse_probe_size
from service.models.experts import NONE, choose
from service.models.registry import load_adapter
from service.models.request import GenerationRequest
from service.offload import enable_layerwise_offload, load_resident

ROOT = Path(__file__).resolve().parents[1]

RUNS = {  # name: (world, mode, expect, offset rank 1 by --offset)
    "resident": (1, "resident", True, False),
    "dp1": (1, "allgather", True, False),
    "dp1-noexpect": (1, "allgather", False, False),
    "dp2-allgather": (2, "allgather", True, False),
    "dp2-offset": (2, "allgather", True, True),
    "dp2-ranklocal": (2, "rank-local", True, True),
}
GB = 1e9
PSS_SLACK = 1.05
PSS_PER_RANK = 1.5e9


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.float().cpu().numpy().tobytes()).hexdigest()


def plan_of(adapter: Any, height: int, width: int, frames: int, steps: int) -> list[int]:
    """The expert of each transformer forward of a default request at this size."""
    req = GenerationRequest(prompt="bench", height=height, width=width, num_frames=frames,
                            num_inference_steps=steps)
    return list(adapter.expert_plan(req))


def works(plan: list[int], world: int, offset: int) -> list[list[int]]:
    """Each rank's forwards: rank 0 one request from its start; with an offset rank r > 0 is
    ``offset`` forwards further on (its request's tail, then the next request's head)."""
    out = []
    for r in range(world):
        k = (offset * r) % len(plan) if offset else 0
        out.append(plan[k:] + plan[:k])
    return out


def tick(queues: list[list[int]]) -> tuple[int, int]:
    """The lock-step rule (engine.experts): this tick's expert (the most ranks' need, ties to
    the earlier) and the next tick's (the same rule over what each needs after it)."""
    now = [q[0] for q in queues if q]
    expert = choose([now.count(e) for e in range(2)])
    after = []
    for q in queues:
        if q:
            after.append((q[1] if len(q) > 1 else NONE) if q[0] == expert else q[0])
    nxt = [a for a in after if a != NONE]
    upcoming = choose([nxt.count(e) for e in range(2)]) if nxt else NONE
    return expert, (0 if upcoming == NONE else upcoming)


def _device(kind: str, rank: int) -> torch.device:
    if kind == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _load(model: str, dev: torch.device, mode: str, world: int) -> tuple[Any, Any, Any]:
    adapter = load_adapter(model)
    module = adapter.build_transformer()
    ckpt = adapter.transformer_checkpoint()
    if mode == "resident":
        load_resident(module, ckpt, dev, keep_fp32=adapter.keep_fp32,
                      block_attrs=list(adapter.offload_block_attrs))
        return adapter, module, None
    group = dist.group.WORLD if world > 1 else None
    handle = enable_layerwise_offload(module, ckpt, device=dev, group=group,
                                      mode=mode,
                                      block_attrs=list(adapter.offload_block_attrs),
                                      keep_fp32=adapter.keep_fp32, experts=adapter.experts)
    return adapter, module, handle


def rank_main(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank of one run: load, then every size's request; figures for the report."""
    dev = _device(cfg["device"], rank)
    before = host_memory()
    t0 = time.perf_counter()
    adapter, module, handle = _load(cfg["model"], dev, cfg["mode"], world)
    load_s = time.perf_counter() - t0
    after_load = host_memory()
    experts = [module.expert(i) for i in range(len(module.names))]
    lockstep = cfg["mode"] == "allgather" and world > 1
    out: dict[str, Any] = {"rank": rank, "load_s": load_s, "sizes": {}}
    for size in cfg["sizes"]:
        height, width, frames = parse_probe_size(size)
        plan = plan_of(adapter, height, width, frames, cfg["steps"])
        x = adapter.probe_inputs(experts[0], height, width, frames, dev)
        queues = works(plan, world, cfg["offset"] if cfg["offset_rank"] else 0)
        first = tick(queues)[0] if lockstep else queues[rank][0]
        with torch.no_grad():  # warm-up: one forward of each expert (kernels, allocator), untimed;
            for e, nxt in ((0, 1), (1, first)):  # the last one prefetches the first timed forward
                if handle is not None:
                    handle.expect(nxt)
                experts[e](**x)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        st0 = handle.stats() if handle is not None else None
        forwards: list[dict[str, Any]] = []
        digests: dict[int, set[str]] = {0: set(), 1: set()}
        ticks = held = 0
        prev = NONE
        t_req = time.perf_counter()
        with torch.no_grad():
            while any(queues) if lockstep else queues[rank]:
                if lockstep:
                    expert, upcoming = tick(queues)
                    mine = queues[rank][0] if queues[rank] else NONE
                else:  # one rank, or rank-local: each rank runs its own forwards
                    q = queues[rank]
                    expert, mine = q[0], q[0]
                    upcoming = q[1] if len(q) > 1 else 0
                ticks += 1
                if handle is not None and cfg["expect"]:
                    handle.expect(upcoming)
                s0 = handle.stats(sync=False) if handle is not None else None
                if mine == expert:
                    with Timer(dev) as t:
                        y = experts[expert](**x)[0]
                    digests[expert].add(_sha(y))
                    del y
                    s1 = handle.stats(sync=False) if handle is not None else None
                    row = {"expert": expert, "switch": prev not in (NONE, expert), "ms": t.ms}
                    if s0 is not None and s1 is not None:
                        row["stall_ms"] = (s1.stall_s - s0.stall_s) * 1e3
                        row["h2d_bytes"] = s1.h2d_bytes - s0.h2d_bytes
                    forwards.append(row)
                    prev = expert
                else:
                    handle.idle_forwards(1, expert)
                    held += 1
                if lockstep:
                    for q in queues:
                        if q and q[0] == expert:
                            q.pop(0)
                else:
                    queues[rank].pop(0)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        wall_s = time.perf_counter() - t_req
        st1 = handle.stats() if handle is not None else None
        w: dict[str, Any] = {"plan": plan, "forwards": forwards, "ticks": ticks, "held_ticks": held,
                             "wall_s": wall_s, "sha256": {str(e): sorted(d) for e, d in digests.items()}}
        if dev.type == "cuda":
            w["device_peak_bytes"] = torch.cuda.max_memory_allocated(dev)
        if st0 is not None and st1 is not None:
            w["stall_ms"] = (st1.stall_s - st0.stall_s) * 1e3
            w["prefetch_redirects"] = st1.prefetch_redirects - st0.prefetch_redirects
            w["gathered_bytes"] = st1.gathered_bytes - st0.gathered_bytes
            if dev.type != "cuda":
                w["device_peak_bytes"] = st1.device_peak_bytes
        out["sizes"][size] = w
    out["host"] = {"before": before, "after_load": after_load, "end": host_memory()}
    if handle is not None:
        out["offload_stats"] = handle.stats().as_dict()
        handle.close()
    return out


def _checkpoint_bytes(model: str) -> int:
    from service.offload.checkpoint import Checkpoint

    adapter = load_adapter(model)
    return sum(Checkpoint(adapter.transformer_checkpoint(e)).nbytes for e in adapter.experts)


def summarize(name: str, ranks: list[dict[str, Any]], size: str, ckpt_bytes: int,
              resident: dict[str, Any] | None) -> dict[str, Any]:
    rows = [f for r in ranks for f in r["sizes"][size]["forwards"]]
    steady = [f["ms"] for f in rows if not f["switch"]]
    switch = [f for f in rows if f["switch"]]
    median = statistics.median(steady) if steady else float("nan")
    pss = sum(r["host"]["end"]["pss_bytes"] for r in ranks)
    world = len(ranks)
    target = PSS_SLACK * ckpt_bytes + PSS_PER_RANK * world
    s = {
        "run": name, "size": size, "world": world,
        "median_ms_per_forward": median,
        "switch_ms": [f["ms"] for f in switch],
        "switch_stall_ms": [f.get("stall_ms", 0.0) for f in switch],
        "median_stall_ms": statistics.median([f.get("stall_ms", 0.0) for f in rows if not f["switch"]]
                                             or [0.0]),
        "forwards": len(rows), "ticks": max(r["sizes"][size]["ticks"] for r in ranks),
        "held_ticks": sum(r["sizes"][size]["held_ticks"] for r in ranks),
        "wall_s": max(r["sizes"][size]["wall_s"] for r in ranks),
        "device_peak_gb": max(r["sizes"][size].get("device_peak_bytes", 0) for r in ranks) / GB,
        "prefetch_redirects": sum(r["sizes"][size].get("prefetch_redirects", 0) for r in ranks),
        "host_pss_gb": pss / GB, "pss_target_gb": target / GB, "pss_within_target": pss <= target,
        "checkpoint_gb": ckpt_bytes / GB,
    }
    if resident is not None:
        want = resident["sizes"][size]["sha256"]
        got = [r["sizes"][size]["sha256"] for r in ranks]
        s["bitwise_equal_resident"] = all(g[e] == want[e] for g in got for e in want if g[e])
        base = summarize("resident", [resident], size, ckpt_bytes, None)["median_ms_per_forward"]
        s["vs_resident"] = median / base if base else None
    for e in ("0", "1"):  # every forward of an expert gave one output
        s[f"distinct_outputs_expert{e}"] = max(len(r["sizes"][size]["sha256"][e]) for r in ranks)
    return s


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| run | size | ms/forward | x resident | switch ms | switch stall ms | stall ms (others) "
            "| ticks/forwards | device peak GB | host PSS GB (target) | redirects | = resident |")
    out = [head, "|" + "---|" * 12]
    for r in rows:
        sw = ", ".join(f"{v:.1f}" for v in r["switch_ms"]) or "-"
        st = ", ".join(f"{v:.1f}" for v in r["switch_stall_ms"]) or "-"
        vs = f"{r['vs_resident']:.3f}" if r.get("vs_resident") else "-"
        out.append(f"| {r['run']} | {r['size']} | {r['median_ms_per_forward']:.1f} | {vs} | {sw} | {st} "
                   f"| {r['median_stall_ms']:.2f} | {r['ticks']}/{r['forwards']} | {r['device_peak_gb']:.2f} "
                   f"| {r['host_pss_gb']:.2f} ({r['pss_target_gb']:.2f}) | {r['prefetch_redirects']} "
                   f"| {r.get('bitwise_equal_resident', '-')} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="CPU, the tiny Wan2.2 A14B T2V demo model, a 32x32x5 request of 4 steps (gloo ranks)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--model", default=None, help="a Wan2.2 A14B pipeline folder (default: the --preset demo)")
    p.add_argument("--preset", default="wan22-a14b-shape")
    p.add_argument("--layers", type=int, default=40, help="blocks per expert of the demo model")
    p.add_argument("--sizes", default="1280x720x81,832x480x33", help="WIDTHxHEIGHTxFRAMES, comma separated")
    p.add_argument("--steps", type=int, default=4,
                   help="denoising steps of the request (CFG: 2 forwards each)")
    p.add_argument("--offset", type=int, default=None,
                   help="forwards rank 1 is ahead in the offset runs (default: half the plan)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma separated, of {','.join(RUNS)}")
    p.add_argument("--timeout", type=float, default=3000, help="seconds per run")
    p.add_argument("--out", default=None,
                   help="JSON path (default loadtest/results/<device>-experts-DATE.json)")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.preset, args.layers = "cpu", "wan22-t2v-tiny", 3
        args.sizes, args.steps = "32x32x5", 4
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        p.error(f"--runs: unknown {unknown}; choose from {list(RUNS)}")
    if args.device == "cuda" and any(RUNS[r][0] > torch.cuda.device_count() for r in runs):
        p.error(f"--runs {runs} need {max(RUNS[r][0] for r in runs)} GPUs, found {torch.cuda.device_count()}")
    if args.model is None:
        from service.models.demo import ensure_demo_model

        args.model = str(ensure_demo_model(args.preset, layers=args.layers))
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    for s in sizes:
        parse_probe_size(s)
    adapter = load_adapter(args.model)
    if len(adapter.experts) != 2:
        p.error(f"--model: {args.model} has {len(adapter.experts)} transformer(s); "
                "this benchmark needs two experts")
    date = dt.datetime.now(dt.UTC)
    out = Path(args.out or ROOT / "loadtest" / "results" / f"{args.device}-experts-{date:%Y-%m-%d}.json")
    plan_len = len(plan_of(adapter, *parse_probe_size(sizes[0]), args.steps))
    offset = args.offset if args.offset is not None else plan_len // 2
    report: dict[str, Any] = {
        **header(args.device), "args": vars(args), "offset": offset,
        "model": {"path": args.model, "card": adapter.card(),
                  "checkpoint_bytes": _checkpoint_bytes(args.model)},
        "runs": {}, "summary": [],
    }
    from ranks import run_ranks

    backend = "nccl" if args.device == "cuda" else "gloo"
    for name in runs:
        world, mode, expect, offset_rank = RUNS[name]
        cfg = {"model": args.model, "device": args.device, "mode": mode, "expect": expect, "sizes": sizes,
               "steps": args.steps, "offset": offset, "offset_rank": offset_rank}
        print(f"[{name}] world {world}, {mode}, expect={expect} ...", flush=True)
        t0 = time.perf_counter()
        try:
            ranks = run_ranks(rank_main, world, cfg, timeout=args.timeout, backend=backend)
        except Exception as e:  # one run failing (an OOM, a timeout) still leaves the others' figures
            report["runs"][name] = {"error": f"{type(e).__name__}: {e}"[-4000:]}
            print(f"[{name}] failed: {e}", file=sys.stderr)
            continue
        report["runs"][name] = {"world": world, "mode": mode, "expect": expect, "ranks": ranks,
                                "seconds": time.perf_counter() - t0}
    resident = report["runs"].get("resident", {}).get("ranks", [None])[0]
    for name, run in report["runs"].items():
        if "ranks" in run:
            for size in sizes:
                report["summary"].append(summarize(name, run["ranks"], size,
                                                   report["model"]["checkpoint_bytes"], resident))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report["summary"]))
    print(f"wrote {out}")
    return 0 if all("ranks" in r for r in report["runs"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
