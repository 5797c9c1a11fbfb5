"""Which request a freed rank starts next, with a fake clock: fast, no Ray."""

from __future__ import annotations

import pytest

from service.router.continuous import ContinuousQueue
from service.router.queue import QueueFull


def fill(q: ContinuousQueue, items: list[tuple[str, float, float]]) -> None:
    for tid, cost, t in items:
        q.submit(tid, "k", None, cost, now=t)


def test_nothing_running_takes_the_oldest() -> None:
    q = ContinuousQueue()
    fill(q, [("big", 9.0, 0.0), ("small", 1.0, 1.0)])
    assert q.pick([], now=2.0).id == "big"
    assert q.pick([0.0], now=2.0).id == "small"


def test_costliest_that_fits_under_the_slowest_running_forward() -> None:
    q = ContinuousQueue()
    fill(q, [("s1", 1.0, 0.0), ("m", 4.0, 1.0), ("xl", 20.0, 2.0), ("m2", 4.0, 3.0)])
    assert q.pick([5.0, 2.0], now=4.0).id == "m"  # rides for free; the older of two equal
    assert q.pick([5.0], now=4.0).id == "m2"
    assert q.pick([0.5], now=4.0).id == "s1"  # none fits: the least slowdown


def test_a_big_request_is_not_starved_by_a_stream_of_small_ones() -> None:
    q = ContinuousQueue(starve_s=30.0)
    q.submit("big", "k", None, 50.0, now=0.0)
    picked, t = [], 0.0
    while "big" not in picked:
        q.submit(f"s{t:.0f}", "k", None, 1.0, now=t)  # a small one arrives every second
        picked.append(q.pick([1.0], now=t).id)  # the other rank runs a small one
        t += 1.0
        assert t < 100
    assert picked[-1] == "big" and 29.0 <= t - 1.0 <= 31.0
    assert all(p.startswith("s") for p in picked[:-1])


def test_bound_cancel_and_retry_after() -> None:
    q = ContinuousQueue(max_queue=2)
    fill(q, [("a", 1.0, 0.0), ("b", 1.0, 0.0)])
    with pytest.raises(QueueFull) as e:
        q.submit("c", "k", None)
    assert e.value.retry_after_s >= 1
    assert q.cancel("a") and not q.cancel("a") and q.depth == 1
    q.record_latency(12.3)
    assert q.retry_after_s() == 13
    with pytest.raises(ValueError):
        q.submit("b", "k", None)
