"""Resuming a request from a saved step (models/resume.py): bit for bit, and only the
forwards of the steps left.

- the scheduler step of a zero model output leaves float32 and bf16 latents as they are,
  bit for bit (what makes the skipped steps free and exact);
- the state round-trips any dtype exactly, and pickles;
- a request resumed from step k gives the frames of an uninterrupted run and makes the
  forwards of its n - k steps only (with CFG: two per step);
- the same with CFG in one forward (``--cfg-batch on``): one forward per step left;
- a model whose scheduler keeps history (the demo's UniPC) is not resumable: a resume is
  refused naming ``resume`` and no latents are handed out.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from service.config import EngineConfig, ModelConfig
from service.models.pipeline import PipelineRunner
from service.models.request import GenerationRequest, RequestError
from service.models.resume import StepState


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_zero_output_euler_step_keeps_the_latents_bitwise(dtype: torch.dtype) -> None:
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(6)
    x = torch.randn(2, 16, 3, 4, 4, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[0, 0, 0, 0, :2] = torch.tensor([-0.0, 0.0], dtype=dtype)  # signed zeros too
    zeros = torch.zeros_like(x)
    for t in sched.timesteps:
        y = sched.step(zeros, t, x, return_dict=False)[0]
        assert y.dtype == dtype
        assert torch.equal(y.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           x.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
        x = y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_state_keeps_the_bytes_and_pickles(dtype: torch.dtype) -> None:
    x = torch.randn(1, 16, 2, 4, 4).to(dtype)
    st = pickle.loads(pickle.dumps(StepState.of(3, 8, x)))
    assert (st.step, st.total, st.shape, st.nbytes) == (3, 8, tuple(x.shape), x.numel() * x.element_size())
    back = st.tensor()
    assert back.dtype == dtype and torch.equal(back, x)


@pytest.fixture(scope="module")
def euler(euler_model: str) -> Iterator[PipelineRunner]:
    runner = PipelineRunner.load(euler_model, "cpu", config=None)
    yield runner
    runner.close()


def counted(runner: PipelineRunner, req: GenerationRequest) -> tuple[np.ndarray, int, list[StepState]]:
    """Frames, transformer forwards and the states handed out, for one run."""
    forwards: list[int] = []
    states: list[StepState] = []
    hook = runner.transformer.register_forward_hook(lambda *_: forwards.append(1))
    try:
        frames = runner.frames(req, on_latents=lambda s, n, lat: states.append(StepState.of(s, n, lat)))
    finally:
        hook.remove()
    return frames, len(forwards), states


@pytest.mark.parametrize("cfg", [5.0, 1.0])
def test_a_resumed_run_is_bitwise_and_runs_only_its_steps(euler: PipelineRunner, cfg: float) -> None:
    req = GenerationRequest(prompt="a fox", seed=3, num_inference_steps=4, guidance_scale=cfg)
    assert euler.resumable(req)
    full, n, states = counted(euler, req)
    per_step = 2 if req.cfg else 1
    assert n == req.forwards() == 4 * per_step
    assert [s.step for s in states] == [1, 2, 3]  # not the last: nothing is left to resume then
    for st in (states[0], states[2]):
        again = req.resumed(st)
        frames, n, later = counted(euler, again)
        assert n == again.forwards() == (4 - st.step) * per_step
        assert np.array_equal(frames, full)
        assert [s.step for s in later] == list(range(st.step + 1, 4))


def test_a_scheduler_with_history_is_not_resumable(resident: PipelineRunner, euler: PipelineRunner) -> None:
    req = GenerationRequest(prompt="a fox", seed=3, num_inference_steps=3)
    _, _, states = counted(euler, req)
    assert not resident.resumable(req)  # the demo model's UniPC keeps its last outputs
    with pytest.raises(RequestError) as e:
        resident.validate(req.resumed(states[0]))
    assert e.value.field == "resume"
    _, _, none = counted(resident, req)
    assert none == []


def test_a_resumed_run_with_cfg_in_one_forward_is_bitwise_too(euler_model: str) -> None:
    runner = PipelineRunner.load(euler_model, "cpu", config=EngineConfig(model=ModelConfig(cfg_batch="on")))
    try:
        req = GenerationRequest(prompt="a fox", seed=5, num_inference_steps=4)
        assert runner.adapter.cfg_batched(req) and runner.resumable(req)
        full, n, states = counted(runner, req)
        assert n == runner.adapter.forwards(req) == 4
        again = req.resumed(states[1])
        frames, n, _ = counted(runner, again)
        assert n == runner.adapter.forwards(again) == 2
        assert np.array_equal(frames, full)
    finally:
        runner.close()
