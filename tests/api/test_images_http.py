"""Image-to-video over real HTTP: `dloserve serve` of a two-expert Wan2.2 I2V model (tiny
preset), DP2 in AllGather mode on its own Ray cluster, against `dloserve generate --image`.

- /v1/models and /readyz say the family and that an image is required; the OpenAPI schema
  requires input_reference and takes it as a file part in a form.
- The MP4 is the same bytes from `dloserve generate --image`, the resident runner in this
  process, a JSON body (data URL, plain base64, OpenAI's reference object), a multipart file
  (raw and through the official openai client) and /v1/videos/sync; requests of other step
  counts run beside it, so the two ranks are in different experts at some ticks.
- Bad images (truncated, another type, a real 30,000 x 30,000 PNG bomb, a header claiming
  that size, 0 bytes, over --max-image-bytes, under another field name, none at all) are each
  a 4xx naming the field, before any rank is asked; the service then serves the next request.
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from service.models.demo import ensure_demo_model
from service.models.pipeline import PipelineRunner
from service.models.request import GenerationRequest
from tests.api import conftest
from tests.api.conftest import ROOT, Serve, wait_final
from tests.api.test_images import bad_images, png, png_bomb
from tests.conftest import free_port

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # the openai client's Sora notice
              pytest.mark.e2e]  # an app of its own on an I2V model (make e2e)
MAX_IMAGE = 256 * 1024
IMAGE = png(56, 40, seed=3)
FIELDS = {"prompt": "a red fox runs through snow", "size": "32x32", "num_frames": 5, "num_inference_steps": 3,
          "seed": 0, "guidance_scale_2": 2.5}
REQ = GenerationRequest(prompt=FIELDS["prompt"], num_inference_steps=3, seed=0, image=IMAGE,
                        extra={"guidance_scale_2": 2.5})


@pytest.fixture(scope="module")
def model() -> str:
    return str(ensure_demo_model("wan22-i2v-tiny"))


@pytest.fixture(scope="module")
def url(model: str) -> Iterator[str]:
    """The service, for the whole module (the autouse clean-up of conftest is per test)."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))
    results = Path(tempfile.mkdtemp(prefix="results"))
    port = free_port()
    s = Serve(ray_tmp, model, "--port", str(port), "--data-parallel-size", "2",
              "--enable-distributed-layerwise-offload", "--dlo-mode", "allgather", "--cpus-per-rank", "0.5",
              "--max-image-bytes", str(MAX_IMAGE), "--results-dir", str(results))
    conftest._started.remove(s)
    try:
        s.watch_until(lambda: "dloserve ready at" in s.output, timeout=400)
        yield f"http://127.0.0.1:{port}"
    finally:
        if s.proc.poll() is None:
            s.stop(signal.SIGTERM, timeout=120)


@pytest.fixture(scope="module")
def cli_mp4(model: str, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    d = tmp_path_factory.mktemp("cli")
    (d / "fox.png").write_bytes(IMAGE)
    cmd = [sys.executable, "-m", "service.cli", "generate", "--model", model, "--quiet",
           "--image", str(d / "fox.png"), "--prompt", FIELDS["prompt"], "--width", "32", "--height", "32",
           "--num-frames", "5", "--steps", "3", "--seed", "0", "--guidance-scale-2", "2.5",
           "--out", str(d / "cli.mp4")]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300, cwd=ROOT,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return (d / "cli.mp4").read_bytes()


def test_the_api_says_what_the_model_does(url: str) -> None:
    models = httpx.get(f"{url}/v1/models").json()
    (card,) = models["data"]
    assert models["object"] == "list" and card["object"] == "model"
    assert card["family"] == "wan22-i2v" and card["tasks"] == ["i2v"] and card["image_input"] == "required"
    assert card["experts"] == ["transformer", "transformer_2"]
    assert httpx.get(f"{url}/v1/models/{card['id']}").json() == card
    assert httpx.get(f"{url}/v1/models/sora-2").status_code == 404
    assert httpx.get(f"{url}/readyz").json()["model_card"]["family"] == "wan22-i2v"
    body = httpx.get(f"{url}/openapi.json").json()["paths"]["/v1/videos"]["post"]["requestBody"]["content"]
    assert "input_reference" in body["application/json"]["schema"]["required"]
    form = body["multipart/form-data"]["schema"]
    assert form["properties"]["input_reference"]["format"] == "binary"
    assert "input_reference" in form["required"]


def test_mp4_bytes_equal_generate_json_multipart_sync_and_openai(url: str, model: str,
                                                                 cli_mp4: bytes) -> None:
    runner = PipelineRunner.load(model, "cpu")
    try:
        assert runner.generate(REQ) == cli_mp4  # the command line is the resident pipeline
        others = {s: runner.generate(GenerationRequest(prompt=f"other {s}", seed=s, num_inference_steps=s,
                                                       image=IMAGE)) for s in (2, 5)}
    finally:
        runner.close()
    b64 = base64.b64encode(IMAGE).decode()
    bodies = [{**FIELDS, "input_reference": f"data:image/png;base64,{b64}"},
              {**FIELDS, "input_reference": b64},
              {**FIELDS, "input_reference": {"image_url": f"data:image/png;base64,{b64}"}}]
    other_bodies = {s: {"prompt": f"other {s}", "seed": s, "num_inference_steps": s, "size": "32x32",
                        "num_frames": 5, "input_reference": b64} for s in (2, 5)}

    def form() -> httpx.Response:
        return httpx.post(f"{url}/v1/videos", data={k: str(v) for k, v in FIELDS.items()},
                          files={"input_reference": ("fox.png", IMAGE, "image/png")}, timeout=60)

    with ThreadPoolExecutor(6) as pool:  # at once: the ranks run requests of 2, 3 and 5 steps side by side
        posts = [pool.submit(httpx.post, f"{url}/v1/videos", json=b, timeout=60) for b in bodies]
        posts += [pool.submit(form)]
        extra = {s: pool.submit(httpx.post, f"{url}/v1/videos", json=b, timeout=60)
                 for s, b in other_bodies.items()}
        ids = [p.result().json()["id"] for p in posts]
        extra_ids = {s: f.result().json()["id"] for s, f in extra.items()}
    for vid in ids:
        assert wait_final(url, vid, timeout=300)["status"] == "completed"
        assert httpx.get(f"{url}/v1/videos/{vid}/content", timeout=30).content == cli_mp4, vid
    for s, vid in extra_ids.items():
        assert wait_final(url, vid, timeout=300)["status"] == "completed"
        assert httpx.get(f"{url}/v1/videos/{vid}/content", timeout=30).content == others[s], s
    sync = httpx.post(f"{url}/v1/videos/sync", data={k: str(v) for k, v in FIELDS.items()},
                      files={"input_reference": ("fox.png", IMAGE, "image/png")}, timeout=300)
    assert sync.status_code == 200 and sync.content == cli_mp4, sync.text[:300]
    sync = httpx.post(f"{url}/v1/videos/sync", json=bodies[0], timeout=300)
    assert sync.status_code == 200 and sync.content == cli_mp4

    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    extra_body = {k: v for k, v in FIELDS.items() if k not in ("prompt", "size")}
    video = client.videos.create_and_poll(prompt=FIELDS["prompt"], size="32x32",  # type: ignore[arg-type]
                                          input_reference=("fox.png", IMAGE, "image/png"),
                                          extra_body=extra_body, poll_interval_ms=200)
    assert video.status == "completed", video
    assert client.videos.download_content(video.id).read() == cli_mp4


def test_bad_images_are_4xx_naming_the_field_and_the_service_goes_on(url: str, cli_mp4: bytes) -> None:
    bad = bad_images(png_bomb())
    bad["over --max-image-bytes"] = png(320, 320, seed=1)  # ~300 KB of noise
    assert len(bad["over --max-image-bytes"]) > MAX_IMAGE and len(bad["bomb"]) < MAX_IMAGE
    fields = {k: str(v) for k, v in FIELDS.items()}
    before = httpx.get(f"{url}/readyz").json()["waves_run"]
    seen = []
    for name, data in bad.items():
        for how in ("multipart", "json"):
            t0 = time.monotonic()
            if how == "multipart":
                r = httpx.post(f"{url}/v1/videos", data=fields,
                               files={"input_reference": ("x.png", data, "image/png")}, timeout=30)
            else:
                r = httpx.post(f"{url}/v1/videos", timeout=30,
                               json={**FIELDS, "input_reference": base64.b64encode(data).decode()})
            seen.append((name, how, r.status_code, round(time.monotonic() - t0, 3)))
            want = 413 if name.startswith("over") else 422
            assert r.status_code == want, (name, how, r.text[:300])
            err = r.json()["error"]
            assert err["param"] == "input_reference" or (how == "multipart" and want == 413), (name, how, err)
    print("\nbad image answers (kind, body, status, seconds):", seen)
    wrong = httpx.post(f"{url}/v1/videos", data=fields, files={"image": ("x.png", IMAGE, "image/png")})
    assert wrong.status_code == 422 and wrong.json()["error"]["param"] == "image"
    wrong = httpx.post(f"{url}/v1/videos", json={**FIELDS, "image": base64.b64encode(IMAGE).decode()})
    assert wrong.status_code == 422 and wrong.json()["error"]["param"] == "image"
    none = httpx.post(f"{url}/v1/videos", json=FIELDS)  # an image-to-video model without an image
    assert none.status_code == 422 and none.json()["error"]["param"] == "input_reference"
    assert httpx.get(f"{url}/readyz").json()["waves_run"] == before  # no rank was asked
    good = {**FIELDS, "input_reference": base64.b64encode(IMAGE).decode()}
    ok = httpx.post(f"{url}/v1/videos/sync", json=good, timeout=300)
    assert ok.status_code == 200 and ok.content == cli_mp4
