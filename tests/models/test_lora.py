"""A request with a LoRA: diffusers' own pipeline gives the same bytes, whatever the strategy.

The reference is ``WanPipeline.from_pretrained`` + ``load_lora_weights`` + ``set_adapters``
(PEFT wrapping the Linears) on the demo checkpoint; dloserve hooks side branches onto its
own meta-built, streamed transformer instead. On CPU in fp32 the two run the same kernels
on the same tensors, so the frames are compared bitwise. Then in a DP2 AllGather group
(and rank-local) one rank runs a request with the adapter while the other runs another
without: each gets the bytes it gets alone, and the base weights are never written.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from loadtest.ranks import run_ranks
from service.config import EngineConfig, OffloadConfig, OffloadMode
from service.models.demo.lora import write_demo_lora
from service.models.lora_ref import LoraRef
from service.models.pipeline import PipelineRunner
from service.models.request import GenerationRequest, RequestError
from service.models.video import to_uint8
from tests.models.aligned import aligned_denoisers

SCALE = 0.8
A = GenerationRequest(prompt="a red fox running through snow", seed=7)  # CFG on: 4 forwards
B = GenerationRequest(prompt="a lighthouse at dusk", negative_prompt="blurry", seed=11)


def sha(frames: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(frames).tobytes()).hexdigest()


@pytest.fixture(scope="module")
def adapters(demo_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("loras")
    return {layout: write_demo_lora(demo_model, out / f"{layout}.safetensors", layout=layout, rank=4,
                                    alpha=8 if layout == "peft" else 2, seed=5)
            for layout in ("peft", "kohya")}


def with_lora(req: GenerationRequest, path: Path, scale: float = SCALE) -> GenerationRequest:
    from dataclasses import replace

    return replace(req, loras=(LoraRef("x", scale, source=str(path)),))


def diffusers_frames(model: str, path: Path | None, req: GenerationRequest) -> np.ndarray:
    from diffusers import WanPipeline

    pipe = aligned_denoisers(WanPipeline.from_pretrained(model))
    pipe.set_progress_bar_config(disable=True)
    if path is not None:
        pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name="x")
        pipe.set_adapters(["x"], [SCALE])
    out = pipe(prompt=req.prompt, negative_prompt=req.negative_prompt, height=req.height, width=req.width,
               num_frames=req.num_frames, num_inference_steps=req.num_inference_steps,
               guidance_scale=req.guidance_scale, generator=torch.Generator().manual_seed(req.seed),
               output_type="np")
    return to_uint8(np.asarray(out.frames[0]))


@pytest.mark.parametrize("layout", ["peft", "kohya"])
def test_resident_equals_diffusers_with_lora(demo_model: str, resident: PipelineRunner,
                                            adapters: dict[str, Path], layout: str) -> None:
    path = adapters[layout]
    before = {k: v.clone() for k, v in resident.transformer.state_dict().items()}
    ours = resident.frames(with_lora(A, path))
    theirs = diffusers_frames(demo_model, path, A)
    assert np.array_equal(ours, theirs)
    plain = resident.frames(A)
    assert not np.array_equal(ours, plain)  # the adapter changes the video
    assert np.array_equal(plain, diffusers_frames(demo_model, None, A))  # hooks gone afterwards
    after = resident.transformer.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # base weights never written
    assert resident.loras.sides.attached == 0


def test_refused_before_compute(resident: PipelineRunner, adapters: dict[str, Path]) -> None:
    calls: list[int] = []
    with pytest.raises(RequestError, match="not registered") as e:
        resident.frames(GenerationRequest(prompt="x", loras=(LoraRef("nope"),)), lambda *a: calls.append(1))
    assert e.value.field == "loras[0].name" and not calls
    with pytest.raises(RequestError, match="named twice"):
        twice = (LoraRef("a", source="p"), LoraRef("a", source="p"))
        resident.frames(GenerationRequest(prompt="x", loras=twice))
    with pytest.raises(RequestError, match="expert must be 'both'"):
        resident.frames(GenerationRequest(prompt="x", loras=(LoraRef("a", expert="low", source="p"),)))


def _mixed(rank: int, world: int, model: str, path: str, out: str) -> None:
    """Each group runs two rounds: rank 0 has A+adapter and rank 1 has B, then swapped."""
    a, b = with_lora(A, Path(path)), B
    results: dict[str, list[str]] = {}
    for name, mode in (("allgather2", OffloadMode.ALLGATHER), ("ranklocal2", OffloadMode.RANK_LOCAL)):
        runner = PipelineRunner.load(model, "cpu", config=EngineConfig(offload=OffloadConfig(mode)),
                                     group=None if
                                     mode is OffloadMode.RANK_LOCAL else torch.distributed.group.WORLD)
        mine = [a, b] if rank == 0 else [b, a]
        results[name] = [sha(runner.frames(req)) for req in mine]
        results[name + "-stats"] = [runner.offload_stats()["gathered_bytes"], runner.loras.stats()["misses"]]
        runner.close()
    Path(out, f"{rank}.json").write_text(json.dumps(results))


@pytest.mark.e2e  # spawned DP2 groups (the resident equality with diffusers stays in make test)
def test_strategies_and_mixed_dp2_group(demo_model: str, resident: PipelineRunner,
                                        adapters: dict[str, Path], tmp_path: Path) -> None:
    path = adapters["peft"]
    want_a, want_b = sha(resident.frames(with_lora(A, path))), sha(resident.frames(B))
    for mode in (OffloadMode.ALLGATHER, OffloadMode.RANK_LOCAL):  # DP1 layerwise, in this process
        runner = PipelineRunner.load(demo_model, "cpu", config=EngineConfig(offload=OffloadConfig(mode)))
        try:
            assert sha(runner.frames(with_lora(A, path))) == want_a, mode
            assert sha(runner.frames(B)) == want_b, mode
        finally:
            runner.close()
    run_ranks(_mixed, 2, demo_model, str(path), str(tmp_path), timeout=None)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        for name in ("allgather2", "ranklocal2"):
            assert got[name] == ([want_a, want_b] if rank == 0 else [want_b, want_a]), (name, rank)
        assert got["allgather2-stats"][0] > 0 and got["ranklocal2-stats"][0] == 0
        assert got["allgather2-stats"][1] == 1  # one adapter read per rank, then cached


def test_frames_that_go_non_finite_fail_the_request(demo_model: str, resident: PipelineRunner,
                                                    tmp_path: Path) -> None:
    """Factors within float32's range (so registration takes them) whose product overflows in
    the forward: the frames are NaN, and the request fails naming that, not a black video."""
    from safetensors.torch import load_file, save_file

    from service.models.adapter import NonFiniteOutput
    from service.models.lora import read_adapter, targets_of
    from service.models.registry import load_adapter

    path = write_demo_lora(demo_model, tmp_path / "loud.safetensors", rank=4, blocks_only=True)
    tensors = {k: v * 1e25 for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    read_adapter(path, "loud", targets_of(load_adapter(demo_model)))  # registration accepts it
    with pytest.raises(NonFiniteOutput, match="NaN or Inf"):
        resident.frames(with_lora(GenerationRequest(prompt="x", seed=1, num_inference_steps=2), path))
    assert resident.loras.sides.attached == 0
    assert resident.frames(GenerationRequest(prompt="x", seed=1, num_inference_steps=2)).any()  # it goes on
