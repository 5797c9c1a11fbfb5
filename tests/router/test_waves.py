"""Wave-forming rules with a fake clock: fast, no Ray. Priorities: the best first, fair between
tenants within one, a wave filled with worse ones of its key only after its better ones."""

from __future__ import annotations

import pytest

from service.router.queue import QueueFull
from service.router.tenants import Tenants
from service.router.waves import WaveRouter


def ids(wave) -> list[str]:  # noqa: ANN001
    return [t.id for t in wave.tickets]


def test_full_wave_forms_at_once_and_keeps_fifo_order() -> None:
    r = WaveRouter(dp_size=2, max_wait_s=10.0)
    for i in range(4):
        r.submit(f"r{i}", "k", None, now=0.0)
    w1, w2 = r.next_wave(now=0.0), r.next_wave(now=0.0)
    assert (ids(w1), w1.reason) == (["r0", "r1"], "full")
    assert ids(w2) == ["r2", "r3"]
    assert r.next_wave(now=0.0) is None and r.depth == 0


def test_lone_request_waits_max_wait_then_goes_partial() -> None:
    r = WaveRouter(dp_size=4, max_wait_s=0.5)
    r.submit("a", "k", None, now=1.0)
    assert r.next_wave(now=1.2) is None
    assert r.wake_in(now=1.2) == pytest.approx(0.3)
    w = r.next_wave(now=1.5)
    assert ids(w) == ["a"] and w.reason == "timeout" and w.size == 1


def test_keys_never_share_a_wave() -> None:
    r = WaveRouter(dp_size=2, max_wait_s=0.0)
    r.submit("a1", "A", None, now=0.0)
    r.submit("b1", "B", None, now=0.1)
    r.submit("a2", "A", None, now=0.2)
    waves = [r.next_wave(now=1.0), r.next_wave(now=1.0)]
    assert [ids(w) for w in waves] == [["a1", "a2"], ["b1"]]
    assert {w.key for w in waves} == {"A", "B"}
    for w in waves:
        assert {t.key for t in w.tickets} == {w.key}


def test_oldest_head_first_across_keys_so_no_key_starves() -> None:
    r = WaveRouter(dp_size=2, max_wait_s=1.0)
    r.submit("b_old", "B", None, now=0.0)
    for i in range(6):
        r.submit(f"a{i}", "A", None, now=0.5 + i * 0.01)
    # Before B times out, the full A waves go; once B is due, it beats A's newer heads.
    assert ids(r.next_wave(now=0.9)) == ["a0", "a1"]
    assert ids(r.next_wave(now=1.0)) == ["b_old"]
    assert ids(r.next_wave(now=1.0)) == ["a2", "a3"]


def test_bounded_queue_raises_with_retry_after() -> None:
    r = WaveRouter(dp_size=2, max_wait_s=1.0, max_queue=3)
    for i in range(3):
        r.submit(f"r{i}", "k", None, now=0.0)
    r.record_wave_latency(4.2)
    with pytest.raises(QueueFull) as e:
        r.submit("r3", "k", None, now=0.0)
    assert e.value.retry_after_s == 5 and e.value.depth == 3
    r.next_wave(now=0.0)
    r.submit("r3", "k", None, now=0.0)  # space again after a wave left


def test_cancel_removes_a_queued_ticket() -> None:
    r = WaveRouter(dp_size=2, max_wait_s=0.0)
    r.submit("x", "k", None, now=0.0)
    r.submit("y", "k", None, now=0.0)
    assert r.cancel("x") and not r.cancel("x")
    assert ids(r.next_wave(now=0.0)) == ["y"]
    assert r.wake_in(now=0.0) is None


def test_duplicate_and_bad_config_rejected() -> None:
    r = WaveRouter(dp_size=1)
    r.submit("x", "k", None)
    with pytest.raises(ValueError):
        r.submit("x", "k", None)
    with pytest.raises(ValueError):
        WaveRouter(dp_size=0)


def test_the_best_priority_goes_first_a_worse_full_key_waits_for_it() -> None:
    r = WaveRouter(dp_size=2, max_wait_s=1.0)
    r.submit("a1", "A", None, now=0.0, priority=5)
    r.submit("a2", "A", None, now=0.0, priority=5)  # A is full, but worse
    r.submit("b1", "B", None, now=0.5, priority=0)
    assert r.next_wave(now=0.9) is None  # B fills or times out first
    assert r.wake_in(now=0.9) == pytest.approx(0.6)  # when B times out, not A's "ready now"
    assert ids(r.next_wave(now=1.5)) == ["b1"]
    assert ids(r.next_wave(now=1.5)) == ["a1", "a2"]


def test_a_wave_takes_its_keys_better_requests_first_and_fills_with_worse_ones() -> None:
    r = WaveRouter(dp_size=2, max_wait_s=1.0)
    for job, p in (("k5a", 5), ("k5b", 5), ("k0", 0), ("k3", 3)):
        r.submit(job, "K", None, now=0.0, priority=p)
    assert ids(r.next_wave(now=0.0)) == ["k0", "k3"]
    assert ids(r.next_wave(now=0.0)) == ["k5a", "k5b"]  # arrival order within a priority


def test_tenants_share_a_priority_in_turn_and_a_better_one_goes_before_whose_turn_it_is() -> None:
    tenants = Tenants()
    r = WaveRouter(dp_size=2, max_wait_s=0.0)
    for job, tenant, p in (("a1", "t1", 0), ("a2", "t1", 0), ("a3", "t1", 0), ("b_low", "t2", 5),
                           ("b1", "t2", 0)):
        r.submit(job, "K", None, now=0.0, tenant=tenant, priority=p)
    r.submit("j_hi", "J", None, now=1.0, tenant="t2", priority=-1)

    def wave() -> list[str]:
        w = r.next_wave(now=2.0, tenants=tenants)
        for t in w.tickets:
            tenants.started(t.tenant)
            tenants.finished(t.tenant)
        return ids(w)

    # t1 comes first in turn, but t2's -1 is the best priority queued: its key goes first
    assert wave() == ["j_hi"]
    # priority 0: t1 and t2 in turn (t2 was served last); t2's worse request waits
    assert wave() == ["a1", "b1"]
    assert wave() == ["a2", "a3"]
    assert wave() == ["b_low"]
