"""The README's first commands as a newcomer runs them: `make serve` (no model: the trained demo
model, DP2 AllGather as the Makefile starts it) and the README's curl give a clip that shows what
its prompt says."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

from service.models.demo.clips import parse_prompt
from service.models.demo.score import score_clip
from service.models.video import decode_mp4
from tests.api.conftest import Serve, wait_final
from tests.conftest import free_port

pytestmark = pytest.mark.e2e
README_BODY = {"prompt": "a red circle moving right on a black background", "seed": 7}


def test_make_serve_and_the_readmes_curl_give_a_clip_that_follows_its_prompt(ray_tmp: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    s = Serve(ray_tmp, "--port", str(port), "--data-parallel-size", "2",
              "--enable-distributed-layerwise-offload", "--cpus-per-rank", "0.5")
    s.watch_until(lambda: "dloserve ready at" in s.output, timeout=300)
    video = httpx.post(f"{url}/v1/videos", json=README_BODY, timeout=30).json()
    assert video["status"] == "queued", video
    done = wait_final(url, video["id"], timeout=300)
    assert done["status"] == "completed", done
    # the model folder's defaults
    assert (done["size"], done["num_frames"], done["num_inference_steps"]) == ("64x64", 17, 20)
    frames = decode_mp4(httpx.get(f"{url}/v1/videos/{video['id']}/content", timeout=30).content)
    got = score_clip(frames, parse_prompt(README_BODY["prompt"]))
    assert (got.colour, got.motion, got.background) == ("red", "right", "black"), got
    assert s.stop(signal.SIGINT) == 0, s.output[-2000:]
