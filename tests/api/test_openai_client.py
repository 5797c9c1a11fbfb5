"""The official openai client, unchanged, drives the service (it posts multipart/form-data)."""

from __future__ import annotations

import warnings

import openai
import pytest

from service.models.request import GenerationRequest

warnings.filterwarnings("ignore", category=DeprecationWarning)


@pytest.fixture(scope="module")
def client(app_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0)


def test_create_and_poll_download_list_delete(client: openai.OpenAI, resident) -> None:  # noqa: ANN001
    video = client.videos.create_and_poll(
        prompt="a lighthouse at dusk",
        size="32x32",  # type: ignore[arg-type] - any WxH the model takes
        seconds="0.5",  # type: ignore[arg-type] - 0.5 s at 8 fps = 5 frames
        poll_interval_ms=100,
        extra_body={"seed": 77, "num_inference_steps": 2, "guidance_scale": 5.0},
    )
    assert video.status == "completed" and video.progress == 100, video
    assert video.size == "32x32" and video.seconds == "0.5"
    data = client.videos.download_content(video.id).read()
    want = resident.generate(GenerationRequest(prompt="a lighthouse at dusk", seed=77))
    assert data == want
    assert client.videos.retrieve(video.id).id == video.id
    assert video.id in [v.id for v in client.videos.list(limit=100)]
    assert client.videos.delete(video.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)


def test_client_sees_422_for_bad_input(client: openai.OpenAI) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.videos.create(prompt="x", size="33x32")  # type: ignore[arg-type]
    assert e.value.body["param"] == "width"
