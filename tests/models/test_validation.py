"""Bad requests and bad model directories fail with errors naming the field or path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from service.config import EngineConfig, OffloadConfig, OffloadMode
from service.models.adapter import ModelError
from service.models.pipeline import PipelineRunner
from service.models.registry import load_adapter
from service.models.request import GenerationRequest, RequestError

OK = GenerationRequest(prompt="a cat")


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"height": 40}, "height", "multiple of 16"),
        ({"width": 8}, "width", "multiple of 16"),
        ({"num_frames": 6}, "num_frames", "4k+1"),
        ({"num_frames": 0}, "num_frames", "[1,"),
        ({"num_inference_steps": 0}, "num_inference_steps", "[1,"),
        ({"prompt": "   "}, "prompt", "empty"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"seed": -1}, "seed", "[0,"),
        ({"fps": 0}, "fps", "[1,"),
        ({"guidance_scale": float("nan")}, "guidance_scale", "[0.0,"),
        ({"height": 32.0}, "height", "integer"),
        ({"extra": {"foo": 1}}, "extra", "foo"),
        ({"extra": {"max_sequence_length": 0}}, "extra.max_sequence_length", "[1, 512]"),
    ],
)
def test_request_errors_name_the_field(demo_model: str, changes: dict, field: str, words: str) -> None:
    import dataclasses

    req = dataclasses.replace(OK, **changes)
    with pytest.raises(RequestError) as e:
        load_adapter(demo_model).validate(req)
    assert e.value.field == field
    assert words in str(e.value) and str(e.value).startswith(field)
    assert isinstance(e.value, ValueError)


def test_rejected_before_any_compute(demo_model: str) -> None:
    runner = PipelineRunner.load(demo_model, "cpu",
                                 config=EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER)))
    try:
        with pytest.raises(RequestError, match="height"):
            runner.generate(GenerationRequest(prompt="a cat", height=33))
        with pytest.raises(RequestError, match="num_frames"):
            runner.idle(GenerationRequest(prompt="a cat", num_frames=4))
        stats = runner.offload_stats()
        assert stats is not None and stats["forwards"] == 0 and stats["idle_forwards"] == 0
        runner.idle(OK)  # a valid idle replay joins exactly OK.forwards() forwards
        assert runner.offload_stats()["idle_forwards"] == OK.forwards() == 4
        # forwards() must count what generate really runs: CFG on (2 per step) and off (1).
        for req in (OK, GenerationRequest(prompt="a cat", guidance_scale=1.0, num_inference_steps=3)):
            before = runner.offload_stats()["forwards"]
            runner.generate(req)
            made = runner.offload_stats()["forwards"] - before
            assert made == runner.adapter.forwards(req) == req.forwards()
    finally:
        runner.close()


def test_compat_key_and_forwards() -> None:
    base = GenerationRequest(prompt="a", seed=1)
    same = GenerationRequest(prompt="something else", negative_prompt="x", seed=99, guidance_scale=7.5)
    assert base.compat_key() == same.compat_key()  # prompt, seed, guidance value: not in it
    no_cfg = GenerationRequest(prompt="a", guidance_scale=1.0)
    assert no_cfg.compat_key() != base.compat_key()
    assert (base.forwards(), no_cfg.forwards()) == (4, 2)
    for change in ({"height": 48}, {"num_frames": 9}, {"num_inference_steps": 3}, {"fps": 16},
                   {"flow_shift": 5.0}, {"extra": {"max_sequence_length": 226}}):
        assert GenerationRequest(prompt="a", **change).compat_key() != base.compat_key(), change
    key = json.loads(base.compat_key())
    assert "prompt" not in key and "seed" not in key and key["cfg"] is True
    assert base.compat_key() == json.dumps(key, sort_keys=True, separators=(",", ":"))


def test_flow_shift_changes_output(resident: PipelineRunner) -> None:
    a = resident.frames(GenerationRequest(prompt="a cat"))
    b = resident.frames(GenerationRequest(prompt="a cat", flow_shift=7.0))
    assert a.shape == b.shape and not (a == b).all()


def _copy(demo_model: str, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(demo_model, dst)
    return dst


def test_unknown_family_names_the_file(demo_model: str, tmp_path: Path) -> None:
    model = _copy(demo_model, tmp_path)
    index = json.loads((model / "model_index.json").read_text())
    index["_class_name"] = "HunyuanVideoPipeline"
    (model / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ModelError, match=r"model_index\.json.*unknown model family 'HunyuanVideoPipeline'"):
        PipelineRunner.load(model)


@pytest.mark.parametrize("component", ["vae", "text_encoder", "tokenizer", "scheduler", "transformer"])
def test_missing_component_names_the_folder(demo_model: str, tmp_path: Path, component: str) -> None:
    model = _copy(demo_model, tmp_path)
    shutil.rmtree(model / component)
    with pytest.raises(ModelError) as e:
        PipelineRunner.load(model)
    assert str(model / component) in str(e.value) and "missing" in str(e.value)


def test_not_a_pipeline_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        load_adapter(tmp_path / "nope")
    with pytest.raises(ModelError, match=r"model_index\.json: missing"):
        load_adapter(tmp_path)
