"""--compile under offload (models.compiled), on CPU with the aot_eager backend.

The block class is compiled once at start-up (the warm-up, a load stage of its own); then
requests whose blocks run from the offload's two slots (every forward points each block's
parameters at another slot view) compile nothing more: dynamo's own counters say how many
graphs it made. The frames equal the eager server's. It composes with FP8 blocks and step
caches (compiled) and LoRA adapters (their requests run the blocks eagerly).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from service.config import EngineConfig, ModelConfig, OffloadConfig, OffloadMode
from service.models import compiled
from service.models.demo.lora import write_demo_lora
from service.models.lora_ref import LoraRef
from service.models.pipeline import PipelineRunner
from service.models.request import GenerationRequest

REQ = GenerationRequest(prompt="a red fox running through snow", seed=7, num_inference_steps=3)
SHAPE = (REQ.height, REQ.width, REQ.num_frames)  # the warm-up at the requests' size


def sha(frames: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(frames).tobytes()).hexdigest()


def graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def eager_frames(model: str, req: GenerationRequest, mode: OffloadMode, quantization: str | None = None
                 ) -> np.ndarray:
    config = EngineConfig(offload=OffloadConfig(mode), model=ModelConfig(quantization=quantization))
    runner = PipelineRunner.load(model, "cpu", config=config)
    try:
        assert runner.compiled is None  # auto on CPU: off
        return runner.frames(req)
    finally:
        runner.close()


@pytest.mark.parametrize("mode", [OffloadMode.ALLGATHER, OffloadMode.RANK_LOCAL], ids=["allgather1",
                                                                                       "ranklocal1"])
def test_slot_swaps_do_not_recompile(demo_model: str, mode: OffloadMode) -> None:
    before = graphs()
    runner = PipelineRunner.load(demo_model, "cpu",
                                 config=EngineConfig(offload=OffloadConfig(mode, probe_shape=SHAPE),
                                                     model=ModelConfig(compile="on")))
    try:
        assert runner.compiled is not None and "compile" in runner.load_stages  # warm-up at start-up
        assert runner.compiled.quantization is None  # bf16 weights: inductor would not tune
        assert runner.describe()["compile"]["classes"] == ["WanTransformerBlock"]
        warm = graphs()
        # One graph for every block of the class (none when an earlier runner in this process
        # compiled it: dynamo caches per code object, guards match).
        assert warm - before <= 1 and warm >= 1
        if warm - before == 1:  # compiled here: the warm-up's seconds by torch's phase are shown
            assert runner.describe()["compile"]["phases_s"], runner.describe()["compile"]
        # the warm-up computed two of the three blocks (the rest only streamed), and the requests
        # below still compile nothing new: the second call had a block's output as its input
        assert runner.describe()["compile"]["warm_calls"] == {"WanTransformerBlock": 2}
        first = runner.frames(REQ)
        again = runner.frames(replace(REQ, seed=8))
        runner.frames(REQ)
        assert graphs() == warm  # 3 requests x 6 forwards x every block through both slots: none new
        assert runner.offload_stats()["forwards"] == 1 + 3 * REQ.forwards()
        assert not np.array_equal(first, again)
    finally:
        runner.close()
    assert np.array_equal(first, eager_frames(demo_model, REQ, mode=mode))


def test_requests_of_other_sizes_do_not_recompile(demo_model: str) -> None:
    """The warm-up compiles the block with its token dimension symbolic: requests of other
    sizes, frame counts and step counts run the warm-up's graph (without the marks the first of
    them compiles again). Dynamo's caches are reset first, so no earlier test's graph serves them."""
    import torch

    torch._dynamo.reset()
    config = EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER, probe_shape=SHAPE),
                          model=ModelConfig(compile="on"))
    runner = PipelineRunner.load(demo_model, "cpu", config=config)
    others = [replace(REQ, height=48, width=32, num_frames=9),
              replace(REQ, height=32, width=48, num_inference_steps=2),
              replace(REQ, height=64, width=64, num_frames=1)]
    try:
        assert runner.describe()["compile"]["dynamic_dims"] >= 3  # the hidden states, cos, sin
        warm = graphs()
        frames = [runner.frames(r) for r in others]
        assert graphs() == warm
    finally:
        runner.close()
    assert np.array_equal(frames[0], eager_frames(demo_model, others[0], mode=OffloadMode.ALLGATHER))


def test_token_dims_are_marked_but_not_channels() -> None:
    import torch

    from service.models.compiled import mark_token_dims

    hidden, cos = torch.zeros(2, 6, 6), torch.zeros(1, 6, 1, 4)
    assert mark_token_dims((hidden,), {"rotary_emb": (cos, cos.clone()), "timestep": torch.zeros(2)}) == 3
    # dim 1 (tokens), not dim 2 (channels, the same size here: a tensor's last dim never is)
    assert getattr(hidden, "_dynamo_weak_dynamic_indices", None) == {1}
    assert getattr(cos, "_dynamo_weak_dynamic_indices", None) == {1}
    assert mark_token_dims((torch.zeros(2, 1, 6),), {}) == 0  # one token: torch specializes it anyway
    assert mark_token_dims((), {"x": torch.zeros(3)}) == 0


def test_composes_with_fp8_and_step_caches(demo_model: str) -> None:
    settings = EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER, probe_shape=SHAPE),
                            model=ModelConfig(compile="on", quantization="fp8"))
    cached = replace(REQ, num_inference_steps=4, cache={"method": "first_block", "threshold": 0.05})
    runner = PipelineRunner.load(demo_model, "cpu", config=settings)
    try:
        assert runner.compiled is not None and runner.compiled.quantization == "fp8"  # inductor would tune
        warm = graphs()
        fp8 = runner.frames(REQ)
        with_cache = runner.frames(cached)
        assert graphs() == warm
    finally:
        runner.close()
    eager = {"mode": OffloadMode.ALLGATHER, "quantization": "fp8"}
    assert np.array_equal(fp8, eager_frames(demo_model, REQ, **eager))
    assert np.array_equal(with_cache, eager_frames(demo_model, cached, **eager))


def test_lora_requests_run_the_blocks_eagerly(demo_model: str, tmp_path: Path) -> None:
    path = write_demo_lora(demo_model, tmp_path / "x.safetensors", layout="peft", rank=4, alpha=8, seed=5)
    lora = replace(REQ, loras=(LoraRef("x", 0.8, source=str(path)),))
    config = EngineConfig(offload=OffloadConfig(OffloadMode.RANK_LOCAL, probe_shape=SHAPE),
                          model=ModelConfig(compile="on"))
    runner = PipelineRunner.load(demo_model, "cpu", config=config)
    try:
        warm = graphs()
        with_lora = runner.frames(lora)
        plain = runner.frames(REQ)
        assert graphs() == warm
    finally:
        runner.close()
    assert not np.array_equal(with_lora, plain)
    assert np.array_equal(with_lora, eager_frames(demo_model, lora, mode=OffloadMode.RANK_LOCAL))


def test_two_experts_compile_and_batch_cfg(tmp_path: Path) -> None:
    """Wan2.2 A14B's two experts share one block class: one graph for both, streamed through
    one ring, with CFG in one forward too (one forward per step, the expert plan follows)."""
    from service.models.demo import ensure_demo_model

    model = str(ensure_demo_model("wan22-t2v-tiny"))
    req = replace(REQ, num_inference_steps=4)
    frames = {}
    for name, comp in (("compiled", "on"), ("eager", "off")):
        config = EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER, probe_shape=SHAPE),
                              model=ModelConfig(compile=comp, cfg_batch="on"))
        runner = PipelineRunner.load(model, "cpu", config=config)
        try:
            assert runner.adapter.forwards(req) == 4 and len(runner.adapter.expert_plan(req)) == 4
            warm = graphs()
            frames[name] = runner.frames(req)
            if comp == "on":
                assert graphs() == warm
                assert runner.offload_stats()["forwards"] == 1 + 4
        finally:
            runner.close()
    assert np.array_equal(frames["compiled"], frames["eager"])


def test_inductor_caches_are_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's caches go to $DLOSERVE_CACHE/inductor (not torch's /tmp default, which a new
    container empties) unless TORCHINDUCTOR_CACHE_DIR is given; the warm-up says what came from
    the caches (none with aot_eager, the CPU backend: only inductor caches)."""
    import torch
    from torch import nn

    from service.models.compiled import CompiledBlocks

    monkeypatch.setenv("DLOSERVE_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    # compiles lazily: nothing runs yet
    compiled = CompiledBlocks(model, ["blocks"], "inductor", quantization=None)
    assert compiled.cache_dir == str(tmp_path / "inductor")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == compiled.cache_dir
    compiled.close()
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert cache_dir() == default_cache_dir()  # torch, asked first, writes its default in the variable
    # ... which is not a choice: ours again
    inductor = CompiledBlocks(model, ["blocks"], "inductor", quantization=None)
    assert inductor.cache_dir == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    given = CompiledBlocks(model, ["blocks"], "inductor", quantization=None)
    assert given.cache_dir == str(tmp_path / "mine")  # given: kept
    eager = CompiledBlocks(model, ["blocks"], "aot_eager", quantization=None)
    eager.warm_up(lambda: model.blocks[1](model.blocks[0](torch.ones(1, 4))))
    cache = eager.describe()["cache"]
    assert cache["dir"] is None and cache["fxgraph_cache_hit"] == 0 and cache["fxgraph_cache_miss"] == 0
    eager.close()


def test_inductor_tunes_kernels_for_fp8_weights_only_and_other_backends_take_no_options(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What ``CompiledBlocks`` hands torch.compile (inductor itself needs a GPU here: its
    arguments are what is checked)."""
    opts = compiled.options_for("inductor", "fp8")
    assert opts == {"coordinate_descent_tuning": True}
    opts["coordinate_descent_tuning"] = False  # a copy: the module's own stays as measured
    assert compiled.FP8_INDUCTOR_OPTIONS["coordinate_descent_tuning"] is True
    assert compiled.options_for("inductor", None) is None  # bf16: the tuning costs the start more
    assert compiled.options_for("aot_eager", "fp8") is None
    seen: list[dict[str, object]] = []

    def record(fn: object, **kwargs: object) -> object:
        seen.append(kwargs)
        return fn

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiled.torch, "compile", record)
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])
    for backend, quantization, options in (("inductor", "fp8", compiled.FP8_INDUCTOR_OPTIONS),
                                           ("inductor", None, None), ("aot_eager", "fp8", None)):
        seen.clear()
        blocks = compiled.CompiledBlocks(model, ["blocks"], backend, quantization=quantization)
        assert seen == [{"backend": backend, "fullgraph": True, "options": options}]  # one class, once
        blocks.close()
