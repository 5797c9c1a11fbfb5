"""The HTTP benchmarks' webhook receiver (loadtest/serving.py): a video's end as its event came."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from loadtest.serving import CompletionHooks


def test_completion_hooks_record_the_first_event_of_each_video(tmp_path: Path) -> None:
    hooks = CompletionHooks()
    try:
        flags = hooks.flags(tmp_path)
        assert flags[:2] == ["--webhook-url", hooks.url]
        assert Path(flags[3]).read_text().startswith("whsec_") and flags[4] == "--webhook-allow-private"
        before = time.monotonic()
        event = {"type": "video.completed", "data": {"id": "video_1"}}
        assert httpx.post(hooks.url, json=event, timeout=10).status_code == 204
        first = hooks.arrived["video_1"]
        httpx.post(hooks.url, json=event, timeout=10)  # a retried delivery: the first time stays
        assert hooks.arrived == {"video_1": first} and before <= first <= time.monotonic()
        assert httpx.post(hooks.url, content=b"not json", timeout=10).status_code == 204
        assert len(hooks.arrived) == 1
    finally:
        hooks.close()
