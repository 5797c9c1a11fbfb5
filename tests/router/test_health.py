"""The group-health rules on their own: the metric's fixed words for a failure, the backoff."""

from __future__ import annotations

from service.router.health import BACKOFF_CAP_S, backoff_s, failure_kind


def test_rebuild_reasons_become_a_fixed_word_for_the_metric_label() -> None:
    assert failure_kind("a request exceeded its deadline") == "deadline"
    assert failure_kind("rank 1 died: SIGKILL") == "rank_died"
    assert failure_kind("rank 0 failed: RuntimeError: video_0123 broke") == "rank_failed"
    gloo = "rank 0 failed: RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer"
    assert failure_kind(gloo) == failure_kind("rank 1 failed: Connection reset by peer") == "peer_lost"
    assert failure_kind("anything else, quoting video_0123") == "other"


def test_a_failed_start_is_tried_again_at_once_then_with_a_capped_backoff() -> None:
    waits = [backoff_s(n) for n in range(1, 9)]
    assert waits[0] == 0.0 and waits == sorted(waits)
    assert max(waits) == BACKOFF_CAP_S == backoff_s(100)
