"""Resident-block planning: even spread, exact counts, the budget and its errors."""

from __future__ import annotations

import pytest

from service.offload.plan import plan_resident, spread


def test_spread_is_even_and_bounded() -> None:
    assert spread(8, 0) == ()
    assert spread(8, 8) == tuple(range(8))
    assert spread(8, 2) == (2, 6)
    assert spread(40, 10) == (2, 6, 10, 14, 18, 22, 26, 30, 34, 38)
    for k in range(0, 41):
        assert len(spread(40, k)) == k
    with pytest.raises(ValueError, match="resident_blocks must be in"):
        spread(4, 5)


def test_budget_takes_the_most_blocks_that_fit() -> None:
    blocks = [100, 100, 100, 100, 100]
    slots = [100, 100, 100, 100, 100]
    for budget in range(250, 800, 7):
        p = plan_resident(blocks, slots, budget=budget, fixed_bytes=40)
        assert p.total_bytes <= budget
        assert p.slot_bytes == (200 if len(p.resident) < 5 else 0)
        k = len(p.resident)
        if k < 5:  # one more resident block would not fit
            bigger = plan_resident(blocks, slots, resident_blocks=k + 1, fixed_bytes=40)
            assert bigger.total_bytes > budget
    # everything resident needs no slots at all
    assert plan_resident(blocks, slots, budget=540).resident == (0, 1, 2, 3, 4)


def test_slots_follow_the_largest_streamed_block() -> None:
    # block 2 is the big one: once it is resident the slots shrink
    blocks = [10, 10, 50, 10]
    p = plan_resident(blocks, blocks, resident_blocks=1)
    assert p.resident == (2,) and p.slot_bytes == 20


def test_budget_errors_name_the_parts() -> None:
    with pytest.raises(ValueError, match="below what streaming every block needs: two slots"):
        plan_resident([100] * 3, [100] * 3, budget=150, fixed_bytes=10)
    with pytest.raises(ValueError, match="not both"):
        plan_resident([100], [100], resident_blocks=1, budget=1000)
    with pytest.raises(ValueError, match="must be > 0"):
        plan_resident([100], [100], budget=0)
