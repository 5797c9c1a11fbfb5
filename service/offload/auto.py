"""``mode="auto"``: pick AllGather or rank-local from a short probe at load.

The choice turns on one comparison per block: compute time against fill time.
AllGather splits each block's H2D across the N ranks' links (fill = B/N over H2D plus
the gather), so it wins when a rank-local fill (B over the rank-local source: the
registered page cache, or the pack thread) would make compute wait. When compute covers
the fill either way, rank-local wins: no lock-step, no gather kernels sharing the GPU.
That cost is ``lockstep_margin`` (0.03: AllGather DP2 reached 0.96 of ideal and
rank-local 0.99 at 32,760 tokens, loadtest/results/h200x2-2026-11-30.json). At N=1 both
fill a whole block over one link; rank-local then wins when its fill is within
``SAME_LINK`` (5%) of the pinned one, as DMA from the registered page cache is (13.3 vs
12.9 ms per 703 MB block, and 152.1 vs 153.6 ms per forward, in
loadtest/results/h200x2-placement-2026-11-30-ranklocal.json): it pins no private copy.

The decision (``choose_mode``) is pure arithmetic on ``ProbeTimings`` so it is tested
with injected timings; the measuring (``probe``) runs a few real forwards.

Two experts (``expert_mix``): an AllGather group runs one expert per tick, so in a tick
where its ranks need different experts only some of them compute (the others replay the
gathers and keep their forward for a later tick). ``expert_mix`` is the extra ticks this
costs as a fraction (the caller simulates the group's rule over request plans:
service.models.experts.lockstep_expert_cost): AllGather is charged ``1 + expert_mix``;
rank-local ranks do not wait for each other and pay nothing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .comm import all_gather
from .layerwise import LayerwiseOffload
from .mode import ModeChoice, OffloadMode, ProbeTimings

__all__ = ["ModeChoice", "ProbeTimings", "choose_mode", "probe"]

LOCKSTEP_MARGIN = 0.03
SAME_LINK = 0.05  # at N=1, fills this close are one PCIe link measured twice
# Mixed shapes in lock-step: a tick lasts as long as the slowest rank's forward. The service's
# mixed batch on two H200s had a 33-frame forward (~1.0 s) beside an 81-frame one (~3.3 s) at
# 480p (README, "Service throughput"): the slowest forward a group sees is ~3x its fastest.
SHAPE_SPREAD = 3.0


def lockstep_cost(world: int, spread: float = SHAPE_SPREAD) -> float:
    """Compute time an AllGather group of ``world`` ranks loses to waiting for its slowest
    forward, as a fraction: forward times spread uniformly over [1/spread, 1] of the slowest,
    a tick takes the max of ``world`` of them, a rank-local rank only its own. 0 at N=1 or
    with one shape (spread 1); 0.17 at N=2 and spread 3."""
    if world <= 1 or spread <= 1:
        return 0.0
    low = 1.0 / spread
    mean = (1.0 + low) / 2
    slowest = low + (1.0 - low) * world / (world + 1)  # E[max of world uniforms on [low, 1]]
    return slowest / mean - 1.0


def allgather_fill_s(t: ProbeTimings) -> float:
    """Fill time of one block in AllGather mode: own shard over H2D, then the gather."""
    shard = t.block_bytes / t.world / t.h2d_bps
    if t.world == 1 or t.gather_bps is None:
        return shard
    return shard + t.block_bytes * (t.world - 1) / t.world / t.gather_bps


def choose_mode(t: ProbeTimings, lockstep_margin: float = LOCKSTEP_MARGIN,
                shape_spread: float = SHAPE_SPREAD, expert_mix: float = 0.0) -> ModeChoice:
    """AllGather or rank-local for these timings, with the reason in words.

    AllGather's compute is charged what lock-step costs with mixed shapes (``lockstep_cost``)
    and ``lockstep_margin`` for the gathers sharing the GPU, and with two experts the ticks
    whose ranks need different experts (``expert_mix``); rank-local ranks pay none of it.
    """
    if min(t.compute_s, t.h2d_bps, t.ranklocal_bps) <= 0 or t.world < 1:
        raise ValueError(f"probe timings must be positive: {t}")
    ag_fill = allgather_fill_s(t)
    rl_fill = t.block_bytes / t.ranklocal_bps
    waits = lockstep_cost(t.world, shape_spread)
    mix = expert_mix if t.world > 1 else 0.0
    ag = max(t.compute_s * (1 + waits), ag_fill) * (1 + mix) * (1 + (lockstep_margin if t.world > 1 else 0.0))
    rl = max(t.compute_s, rl_fill)
    if t.world == 1 and rl_fill <= ag_fill * (1 + SAME_LINK):
        rl = min(rl, ag)  # one rank, both over the same link: no private pinned copy wins
    ms = 1e3
    facts = (f"per block: compute {t.compute_s * ms:.2f} ms, AllGather fill {ag_fill * ms:.2f} ms "
             f"(N={t.world}), rank-local fill {rl_fill * ms:.2f} ms ({t.ranklocal_source})")
    if waits:
        facts += f"; lock-step with mixed shapes costs AllGather {waits:.0%} of compute"
    if mix:
        facts += f"; ranks in different experts cost AllGather an estimated {mix:.0%} more ticks"
    if rl <= ag:
        why = ("compute covers the rank-local fill: no lock-step, no gathers"
               if rl_fill <= t.compute_s else
               "rank-local fills as fast as AllGather here and pins no private copy")
        return ModeChoice(OffloadMode.RANK_LOCAL, f"{why}; {facts}", ag, rl, t)
    why = (f"rank-local would be transfer-bound ({rl * ms:.2f} ms/block against "
           f"{ag * ms:.2f} ms with AllGather)")
    return ModeChoice(OffloadMode.ALLGATHER, f"{why}; {facts}", ag, rl, t)


def agree(t: ProbeTimings, group: dist.ProcessGroup | None, device: torch.device) -> ProbeTimings:
    """The worst timings over the group, so every rank makes the same choice."""
    if group is None or dist.get_world_size(group) == 1:
        return t
    dev = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    slow = torch.tensor([t.compute_s, 1 / t.h2d_bps, 1 / t.ranklocal_bps,
                         0.0 if t.gather_bps is None else 1 / t.gather_bps, float(t.activation_bytes)],
                        dtype=torch.float64, device=dev)
    dist.all_reduce(slow, op=dist.ReduceOp.MAX, group=group)
    c, h, r, g, a = slow.tolist()
    return ProbeTimings(t.world, t.block_bytes, c, 1 / h, 1 / r, None if g == 0 else 1 / g,
                        t.ranklocal_source, int(a))


# -- measuring --------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rate(nbytes: int, fn: Callable[[], None], device: torch.device, reps: int = 3) -> float:
    """Bytes/s of ``fn`` (median of ``reps`` after one warm-up)."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return nbytes / max(statistics.median(times), 1e-9)


def block_compute_s(blocks: list[torch.nn.Module], forward: Callable[[], None], device: torch.device,
                    forwards: int = 2) -> float:
    """Median compute time of one block over the last of ``forwards`` forwards.

    Hooks registered after the offload's run after its wait for the slot, so the time
    is the block's own compute (CUDA events on the compute stream; wall time on CPU).
    """
    marks: list[tuple[object, object]] = []
    cuda = device.type == "cuda"

    def now() -> object:
        if cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def pre(_m: torch.nn.Module, _a: object) -> None:
        marks.append((now(), None))

    def post(_m: torch.nn.Module, _a: object, _o: object) -> None:
        marks[-1] = (marks[-1][0], now())

    hooks = [h for b in blocks for h in (b.register_forward_pre_hook(pre), b.register_forward_hook(post))]
    try:
        for _ in range(forwards):
            marks.clear()
            forward()
        _sync(device)
    finally:
        for h in hooks:
            h.remove()
    spans = [(a.elapsed_time(b) / 1e3 if cuda else b - a) for a, b in marks]  # type: ignore[union-attr,operator]
    return statistics.median(spans)


def h2d_bps(nbytes: int, device: torch.device) -> float:
    """Pinned host -> device bytes/s (on CPU: a host memcpy).

    Pinned with cudaHostRegister and unpinned after: torch's caching host allocator would
    keep a power-of-two block (1 GiB for a 703 MB block) pinned for the process's life.
    """
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    cuda = device.type == "cuda"
    if cuda and int(torch.cuda.cudart().cudaHostRegister(src.data_ptr(), nbytes, 0)) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed")
    try:
        return _rate(nbytes, lambda: dst.copy_(src, non_blocking=True), device)
    finally:
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.cudart().cudaHostUnregister(src.data_ptr())


def gather_bps(nbytes: int, group: dist.ProcessGroup, device: torch.device) -> float:
    """AllGather output bytes/s of one block-sized gather over ``group``."""
    world = dist.get_world_size(group)
    shard = -(-nbytes // world)
    dev = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    out = torch.empty(shard * world, dtype=torch.uint8, device=dev)
    chunk = torch.empty(shard, dtype=torch.uint8, device=dev)
    return _rate(shard * world, lambda: all_gather(out, chunk, group=group), dev)


def ranklocal_bps(handle: LayerwiseOffload) -> float:
    """Bytes/s of a rank-local fill of the largest streamed block through its own source.

    Page cache: the DMA copies themselves. Pack: the pack thread and the H2D overlap
    across blocks, so the rate is the slower of the two.
    """
    host, dev = handle.host, handle.device.device
    pos = max(range(len(host.blocks)), key=lambda i: host.blocks[i].layout.total_bytes)
    n = host.blocks[pos].layout.total_bytes
    out = torch.empty(n, dtype=torch.uint8, device=dev)
    if host.source == "pagecache":
        pairs = host.dma_pairs(pos, out)
        return _rate(n, lambda: [d.copy_(s, non_blocking=True) for d, s in pairs], dev)
    if dev.type != "cuda":
        return _rate(n, lambda: host.pack(pos, out), dev)
    staging = torch.empty(n, dtype=torch.uint8)
    pack = _rate(n, lambda: host.pack(pos, staging), torch.device("cpu"))
    return min(pack, h2d_bps(n, dev))


def probe(handle: LayerwiseOffload, forward: Callable[[], None],
          group: dist.ProcessGroup | None = None) -> ProbeTimings:
    """Measure what ``choose_mode`` needs with ``handle`` (a rank-local handle is cheapest:
    no shards to build) and ``forward`` (one forward at the workload to plan for)."""
    dev = handle.device.device
    blocks = [handle._blocks[i] for i in handle._streamed] or handle._blocks
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    compute = block_compute_s(blocks, forward, dev)
    activation = int(torch.cuda.max_memory_allocated(dev) - base) if dev.type == "cuda" else 0
    nbytes = max(lay.total_bytes for lay in handle.layouts)
    world = dist.get_world_size(group) if group is not None else 1
    t = ProbeTimings(
        world=world,
        block_bytes=nbytes,
        compute_s=compute,
        h2d_bps=h2d_bps(nbytes, dev),
        ranklocal_bps=ranklocal_bps(handle) if handle.host.blocks else h2d_bps(nbytes, dev),
        gather_bps=gather_bps(nbytes, group, dev) if world > 1 else None,
        ranklocal_source=handle.host.source,
        activation_bytes=activation,
    )
    return agree(t, group, dev)
