"""The trained demo model ("shapes"), the default model: committed in the real diffusers layout,
small, with its training log and its own default request, and it draws what its prompt says."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from service.config import EngineConfig
from service.models.adapter import ModelError
from service.models.demo import shapes
from service.models.demo.clips import parse_prompt
from service.models.demo.score import score_clip
from service.models.pipeline import PipelineRunner
from service.models.registry import DEFAULTS_FILE, load_adapter, request_defaults, resolve_model
from service.models.request import GenerationRequest

README_PROMPT = "a red circle moving right on a black background"  # the README's curl


def test_it_is_the_default_model_a_wan_pipeline_under_25_mb_with_its_log() -> None:
    folder = shapes.model_dir()
    assert resolve_model(None) == str(folder)
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert load_adapter(folder).family == "wan-t2v"
    size = sum(f.stat().st_size for f in folder.parent.rglob("*") if f.is_file())
    assert size <= 25 * 2**20, size
    log = json.loads((folder / "training_log.json").read_text())
    for phase in ("transformer", "lora"):
        assert log["phases"][phase]["steps"] > 0 and log["phases"][phase]["loss"]
    assert "vae" in log["init"]["phases"] and log["seed"] == 0
    assert request_defaults(folder) == shapes.REQUEST


def test_a_folders_defaults_are_checked_naming_the_file(tmp_path: Path) -> None:
    assert request_defaults(tmp_path) == {}
    f = tmp_path / DEFAULTS_FILE
    for text, words in (("[1]", "not a JSON object"), ("{", "not a JSON object"),
                        ('{"size": 3}', "'size' is not a request default"),
                        ('{"width": "64"}', "'width' must be int"), ('{"num_frames": true}', "must be int")):
        f.write_text(text)
        with pytest.raises(ModelError, match=words) as e:
            request_defaults(tmp_path)
        assert str(f) in str(e.value)


def test_the_default_request_draws_what_the_readmes_prompt_says() -> None:
    runner = PipelineRunner.load(shapes.model_dir(), "cpu", config=EngineConfig())
    try:
        req = GenerationRequest(prompt=README_PROMPT, seed=7, **request_defaults(shapes.model_dir()))
        frames = runner.frames(req)
        assert frames.shape == (17, 64, 64, 3)
        got = score_clip(frames, parse_prompt(README_PROMPT))
        assert (got.colour, got.motion, got.background) == ("red", "right", "black"), got
        blue = "a blue square moving up on a white background"
        other = score_clip(runner.frames(replace(req, prompt=blue)), parse_prompt(blue))
        assert other.background == "white" and other.colour != "red", other  # the words steer it
    finally:
        runner.close()
