"""Resuming a request from a saved step (models/resume.py, models/loop.py): bit for bit, and
only the forwards of the steps left.

- the state round-trips any dtype exactly, the loop's tree too (tuples, numpy arrays, a
  tensor two attributes share), and pickles;
- a request resumed from step k gives the frames of an uninterrupted run and makes the
  forwards of its n - k steps only, for UniPC (the demo presets' scheduler, Wan's published
  one), flow-matching Euler, a step cache on (First Block Cache, MagCache), Wan2.2's two
  experts (its expert plan too) and I2V; with CFG in one forward as well;
- a state without the loop's (an older file) is refused naming ``resume``.

Each model is an explicit demo preset: the default model may change.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from service.config import EngineConfig, ModelConfig
from service.config.cache import CacheSpec
from service.models.demo import ensure_demo_model
from service.models.pipeline import PipelineRunner
from service.models.request import GenerationRequest, RequestError
from service.models.resume import StepState
from tests.models.test_families import IMAGE

SMALL = dict(prompt="a fox", negative_prompt="rain", seed=3, height=32, width=32, num_frames=5,
             num_inference_steps=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_state_keeps_the_bytes_and_pickles(dtype: torch.dtype) -> None:
    x = torch.randn(1, 16, 2, 4, 4).to(dtype)
    shared = torch.randn(3, 2).to(dtype)
    loop = {"scheduler": {"model_outputs": [None, shared], "last": shared, "n": 3, "f": 0.5, "b": True,
                          "pair": (1, shared), "arr": np.arange(5, dtype=np.float64), "none": None},
            "hooks": {"0/blocks.0/h": {"cond": {"r": x[0], "ok": False}}},
            "generator": torch.Generator().get_state()}
    st = pickle.loads(pickle.dumps(StepState.of(3, 8, x, loop)))
    assert (st.step, st.total, st.shape) == (3, 8, tuple(x.shape))
    assert st.nbytes == x.numel() * x.element_size() * 2 + shared.numel() * shared.element_size() + 40 + 5056
    back = st.tensor()
    assert back.dtype == dtype and torch.equal(back, x)
    tree = st.loop_tree()
    s = tree["scheduler"]
    assert s["model_outputs"][0] is None and s["model_outputs"][1] is s["last"] is s["pair"][1]
    assert torch.equal(s["last"], shared) and s["last"].dtype == dtype
    assert (s["n"], s["f"], s["b"], s["none"]) == (3, 0.5, True, None) and isinstance(s["pair"], tuple)
    assert s["arr"].dtype == np.float64 and np.array_equal(s["arr"], np.arange(5))
    assert torch.equal(tree["hooks"]["0/blocks.0/h"]["cond"]["r"], x[0])
    assert torch.equal(tree["generator"], loop["generator"])


@pytest.fixture(scope="module")
def runners(euler_model: str) -> Iterator[dict[str, PipelineRunner]]:
    made: dict[str, PipelineRunner] = {}

    def get(name: str) -> PipelineRunner:
        if name not in made:
            path = euler_model if name == "euler" else str(ensure_demo_model(name))
            made[name] = PipelineRunner.load(path, "cpu", config=None)
        return made[name]

    yield get  # type: ignore[misc]
    for r in made.values():
        r.close()


def counted(runner: PipelineRunner, req: GenerationRequest) -> tuple[np.ndarray, int, list[StepState]]:
    """Frames, transformer forwards and the states handed out (through pickle, as to the
    driver), for one run."""
    forwards: list[int] = []
    states: list[StepState] = []
    hooks = [m.register_forward_hook(lambda *_: forwards.append(1)) for m in runner.experts]
    try:
        frames = runner.frames(req, on_latents=lambda s, n, lat, loop: states.append(
            pickle.loads(pickle.dumps(StepState.of(s, n, lat, loop)))))
    finally:
        for h in hooks:
            h.remove()
    return frames, len(forwards), states


CASES = {  # name -> (runner, request)
    "unipc": ("tiny", GenerationRequest(**SMALL)),
    "unipc-no-cfg": ("tiny", GenerationRequest(**SMALL, guidance_scale=1.0)),
    "euler": ("euler", GenerationRequest(**SMALL)),
    "first-block-cache": ("tiny", GenerationRequest(**SMALL, cache=CacheSpec("first_block", threshold=0.2))),
    "mag-cache": ("tiny", GenerationRequest(**SMALL, cache=CacheSpec(
        "mag", threshold=0.5, max_skip_steps=2, retention_ratio=0.2, mag_ratios=(1.0, 0.99, 0.98, 0.97)))),
    "two-experts": ("wan22-t2v-tiny", GenerationRequest(**SMALL, extra={"guidance_scale_2": 2.5})),
    "i2v": ("wan-i2v-tiny", GenerationRequest(**SMALL, image=IMAGE)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_resumed_run_is_bitwise_and_runs_only_its_steps(runners, case: str) -> None:  # noqa: ANN001
    name, req = CASES[case]
    runner = runners(name)
    assert runner.resumable(req), runner.resume_blocker(req)
    full, n, states = counted(runner, req)
    assert [s.step for s in states] == [1, 2, 3]  # not the last: nothing is left to resume then
    for st in (states[0], states[2]):
        again = req.resumed(st)
        plan = runner.adapter.expert_plan(again)
        assert plan == runner.adapter.expert_plan(req)[-len(plan):]
        assert len(plan) == runner.adapter.forwards(again)
        frames, n, later = counted(runner, again)
        assert n == runner.adapter.forwards(again) == again.forwards()
        assert np.array_equal(frames, full), f"{case}: resumed from step {st.step}"
        assert [s.step for s in later] == list(range(st.step + 1, 4))


def test_two_experts_resume_on_the_low_noise_expert(runners) -> None:  # noqa: ANN001
    """The plan of a resume past the switch holds the second expert only (the demo's boundary
    0.875 switches after the first of 4 steps)."""
    _, req = CASES["two-experts"]
    runner = runners("wan22-t2v-tiny")
    st = counted(runner, req)[2][1]
    assert set(runner.adapter.expert_plan(req)) == {0, 1}
    assert set(runner.adapter.expert_plan(req.resumed(st))) == {1}


def test_a_state_without_the_loop_is_refused(runners) -> None:  # noqa: ANN001
    runner = runners("tiny")
    req = GenerationRequest(**SMALL)
    st = counted(runner, req)[2][0]
    bare = StepState(st.step, st.total, st.dtype, st.shape, st.data)
    with pytest.raises(RequestError) as e:
        runner.frames(req.resumed(bare))
    assert e.value.field == "resume"


def test_a_resumed_run_with_cfg_in_one_forward_is_bitwise_too() -> None:
    runner = PipelineRunner.load(str(ensure_demo_model("tiny")), "cpu",
                                 config=EngineConfig(model=ModelConfig(cfg_batch="on")))
    try:
        req = GenerationRequest(**SMALL)
        assert runner.adapter.cfg_batched(req) and runner.resumable(req)
        full, n, states = counted(runner, req)
        assert n == runner.adapter.forwards(req) == 4
        again = req.resumed(states[1])
        frames, n, _ = counted(runner, again)
        assert n == runner.adapter.forwards(again) == 2
        assert np.array_equal(frames, full)
    finally:
        runner.close()
