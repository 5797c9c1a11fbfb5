"""The N-process launcher: results come back in rank order; a failed rank stops the rest."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from loadtest.ranks import run_ranks


def _sum(rank: int, world: int, base: int) -> int:
    import torch

    t = torch.tensor([rank + base])
    dist.all_reduce(t)
    return int(t.item())


def _one_fails(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one gave up")
    dist.barrier()  # would wait for rank 1 until the group timeout


def test_results_in_rank_order() -> None:
    assert run_ranks(_sum, 3, 10) == [33, 33, 33]


@pytest.mark.timeout(120)
def test_failed_rank_stops_the_others() -> None:
    with pytest.raises(RuntimeError, match="rank one gave up"):
        run_ranks(_one_fails, 2, timeout=None)
