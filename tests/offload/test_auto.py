"""Auto mode: the decision from injected timings, agreement over a real gloo group, the probe."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loadtest.ranks import run_ranks
from service.offload import enable_layerwise_offload
from service.offload.auto import ProbeTimings, agree, allgather_fill_s, choose_mode, lockstep_cost, probe
from service.offload.mode import OffloadMode

from .toy import empty_model, make_checkpoint

BLOCK = 703_000_000  # one Wan2.1-14B block
GB = 1e9


def timings(world: int, compute_ms: float, rl_gbps: float = 20.0, source: str = "pack",
            gather_gbps: float | None = 500.0) -> ProbeTimings:
    return ProbeTimings(world, BLOCK, compute_ms / 1e3, 55 * GB, rl_gbps * GB,
                        gather_gbps * GB if gather_gbps else None, source)


@pytest.mark.parametrize(("world", "compute_ms", "rl_gbps", "source", "want"), [
    (2, 4.1, 20.0, "pack", "allgather"),  # 4,096 tokens: transfer-bound, AllGather halves H2D
    (2, 4.1, 55.0, "pagecache", "allgather"),  # still: 12.8 ms rank-local vs 6.4 + 0.7 ms
    (2, 68.0, 20.0, "pack", "rank-local"),  # 32,760 tokens: compute covers a 35 ms pack
    (2, 273.0, 20.0, "pack", "rank-local"),  # 75,600 tokens
    (1, 4.1, 20.0, "pack", "allgather"),  # DP1 images: the pack is slower than pinned H2D
    (1, 4.1, 55.0, "pagecache", "rank-local"),  # DP1, same link speed: no private pinned copy
    (1, 4.1, 52.7, "pagecache", "rank-local"),  # DP1, 4% slower DMA (measured on H200): same link
    (1, 4.1, 45.0, "pagecache", "allgather"),  # DP1, 18% slower: the pinned copy is worth it
    (1, 68.0, 20.0, "pack", "rank-local"),
])
def test_choice(world: int, compute_ms: float, rl_gbps: float, source: str, want: str) -> None:
    c = choose_mode(timings(world, compute_ms, rl_gbps, source), shape_spread=1.0)
    assert c.mode == want, c.reason
    assert f"compute {compute_ms:.2f} ms" in c.reason and source in c.reason
    assert c.as_dict()["timings"]["world"] == world


def test_margin_decides_near_ties() -> None:
    # compute just above the rank-local fill at DP2: both compute-bound, lock-step costs 3%
    t = timings(2, 36.0, rl_gbps=20.0)
    assert choose_mode(t, shape_spread=1.0).mode == "rank-local"
    # rank-local fill 10% above compute: with one shape AllGather (fill 7 ms) wins despite
    # the margin; with mixed shapes the lock-step waits (17% at N=2) outweigh the 10%
    t = timings(2, BLOCK / (20 * GB) / 1.10 * 1e3, rl_gbps=20.0)
    assert choose_mode(t, shape_spread=1.0).mode == "allgather"
    assert choose_mode(t, lockstep_margin=0.2, shape_spread=1.0).mode == "rank-local"
    mixed = choose_mode(t)
    assert mixed.mode == "rank-local" and "lock-step with mixed shapes costs AllGather 17%" in mixed.reason
    # 30% above compute: AllGather still worth it, shapes mixed or not
    assert choose_mode(timings(2, BLOCK / (20 * GB) / 1.30 * 1e3, rl_gbps=20.0)).mode == "allgather"


def test_lockstep_cost_grows_with_ranks_and_spread() -> None:
    assert lockstep_cost(1) == lockstep_cost(4, spread=1.0) == 0.0
    assert lockstep_cost(2) == pytest.approx(7 / 9 / (2 / 3) - 1)  # E[max] 7/9 over a mean of 2/3
    assert lockstep_cost(2) < lockstep_cost(4) < lockstep_cost(8) < lockstep_cost(8, spread=6.0)


def test_a_slow_gather_makes_allgather_lose() -> None:
    slow = timings(2, 4.1, rl_gbps=30.0, gather_gbps=20.0)  # gather over a slow fabric
    assert allgather_fill_s(slow) > BLOCK / (30 * GB)
    assert choose_mode(slow).mode == "rank-local"
    unmeasured = timings(2, 4.1, gather_gbps=None)
    assert allgather_fill_s(unmeasured) == pytest.approx(BLOCK / 2 / (55 * GB))


def test_bad_timings_are_refused() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        choose_mode(timings(2, 0.0))


def _agree_main(rank: int, world: int) -> str:
    # rank 1 computes slower: both ranks must take the worst and choose alike
    t = timings(world, 4.1 if rank == 0 else 80.0, rl_gbps=20.0 + rank)
    got = agree(t, dist.group.WORLD, torch.device("cpu"))
    assert got.compute_s == pytest.approx(0.080) and got.ranklocal_bps == pytest.approx(20 * GB)
    return choose_mode(got).mode


def test_ranks_agree_on_the_worst_timings() -> None:
    assert run_ranks(_agree_main, 2) == ["rank-local", "rank-local"]


def test_probe_measures_a_real_forward(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    make_checkpoint(str(path))
    model = empty_model()
    h = enable_layerwise_offload(model, path, device="cpu", mode=OffloadMode.RANK_LOCAL)
    x = torch.randn(2, 9, 16)
    with torch.inference_mode():
        t = probe(h, lambda: model(x))
    h.close()
    assert t.world == 1 and t.block_bytes == max(lay.total_bytes for lay in h.layouts)
    assert t.compute_s > 0 and t.h2d_bps > 0 and t.ranklocal_bps > 0 and t.gather_bps is None
    assert choose_mode(t).mode in ("allgather", "rank-local")
