"""Which blocks stay resident on the device, under a count or a memory budget.

Keeping K of L blocks resident cuts the bytes moved per forward by K/L, which is the
whole cost of a transfer-bound forward (images, short clips). The K blocks are spread
evenly over the depth rather than taken from one end: a streamed block's copy then
overlaps the compute of the resident blocks before it, so the forward approaches
max(compute, (L-K)/L x bytes / H2D) instead of paying the streamed run in one stretch.

The budget counts everything the runtime itself puts on the device: the non-block
tensors, the resident blocks, the two slots (sized by the largest *streamed* block) and
an activation reserve the caller measured (``activation_bytes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def spread(n_blocks: int, k: int) -> tuple[int, ...]:
    """``k`` block indices of ``n_blocks``, spaced evenly (the same on every rank)."""
    if not 0 <= k <= n_blocks:
        raise ValueError(f"resident_blocks must be in [0, {n_blocks}], got {k}")
    return tuple(sorted({min(n_blocks - 1, int((j + 0.5) * n_blocks / k)) for j in range(k)})) if k else ()


@dataclass(frozen=True)
class ResidentPlan:
    """The resident set and what it costs on the device (bytes)."""

    resident: tuple[int, ...]
    resident_bytes: int
    slot_bytes: int  # both slots together; 0 when nothing is streamed
    fixed_bytes: int  # non-block tensors + activation reserve
    budget: int | None

    @property
    def total_bytes(self) -> int:
        return self.resident_bytes + self.slot_bytes + self.fixed_bytes


def plan_resident(
    block_bytes: Sequence[int],
    slot_size: Sequence[int],
    *,
    resident_blocks: int | None = None,
    budget: int | None = None,
    fixed_bytes: int = 0,
) -> ResidentPlan:
    """Choose the resident blocks: exactly ``resident_blocks``, or as many as ``budget`` allows.

    ``block_bytes[i]`` is what block i costs resident, ``slot_size[i]`` what a slot must
    hold to stream it (padded for AllGather). With a budget, the largest K whose total
    fits is taken; a budget that cannot hold even the two slots raises, naming the parts.
    """
    n = len(block_bytes)
    if resident_blocks is not None and budget is not None:
        raise ValueError("give resident_blocks or device_memory_budget, not both")

    def plan(k: int) -> ResidentPlan:
        res = spread(n, k)
        streamed = [slot_size[i] for i in range(n) if i not in set(res)]
        slots = 2 * max(streamed) if streamed else 0
        return ResidentPlan(res, sum(block_bytes[i] for i in res), slots, fixed_bytes, budget)

    if budget is None:
        return plan(resident_blocks or 0)
    if budget <= 0:
        raise ValueError(f"device_memory_budget must be > 0 bytes, got {budget}")
    for k in range(n, -1, -1):
        p = plan(k)
        if p.total_bytes <= budget:
            return p
    p = plan(0)
    gib = 2**30
    raise ValueError(
        f"device_memory_budget {budget / gib:.2f} GiB is below what streaming every block needs: "
        f"two slots {p.slot_bytes / gib:.2f} GiB + non-block tensors and activations "
        f"{p.fixed_bytes / gib:.2f} GiB = {p.total_bytes / gib:.2f} GiB"
    )
