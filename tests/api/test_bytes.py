"""The service's MP4 for a request equals `dloserve generate` (resident) for it, every time.

Issue 9's request, sent six times (three JSON bodies, three multipart forms as the openai
client sends them) to the DP2 DLO service: every download is the file the command line
writes for the same fields, byte for byte.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import GPUS_PER_RANK, wait_final

FIELDS = {"prompt": "a red fox runs through snow", "size": "96x64", "num_frames": 9,
          "num_inference_steps": 3, "seed": 0}


def generate_cli(model: str, out: Path) -> bytes:
    cmd = [sys.executable, "-m", "service.cli", "generate", "--model", model, "--quiet",
           "--prompt", FIELDS["prompt"], "--width", "96", "--height", "64", "--num-frames", "9",
           "--steps", "3", "--seed", "0", "--out", str(out), "--device", "cuda" if GPUS_PER_RANK else "cpu"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return out.read_bytes()


@pytest.mark.e2e  # a `dloserve generate` subprocess and six requests through the DP2 service
def test_service_bytes_equal_dloserve_generate(app_url: str, demo_model: str, tmp_path: Path) -> None:
    want = generate_cli(demo_model, tmp_path / "cli.mp4")
    ids = []
    for i in range(6):
        if i % 2 == 0:
            r = httpx.post(f"{app_url}/v1/videos", json=FIELDS, timeout=30)
        else:  # multipart/form-data: every value a text part
            parts = {k: (None, str(v)) for k, v in FIELDS.items()}
            r = httpx.post(f"{app_url}/v1/videos", files=parts, timeout=30)
        assert r.status_code == 202, r.text
        ids.append(r.json()["id"])
    for vid in ids:
        assert wait_final(app_url, vid)["status"] == "completed"
        got = httpx.get(f"{app_url}/v1/videos/{vid}/content", timeout=30)
        assert got.status_code == 200 and got.content == want, vid
