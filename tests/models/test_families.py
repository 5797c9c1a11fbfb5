"""Every Wan family against diffusers' own pipeline class on the same saved checkpoint.

For Wan2.1 I2V, Wan2.2 A14B T2V and I2V and TI2V-5B (text, and text + image) a tiny
pipeline is assembled from diffusers/transformers classes and saved by the pipeline's own
``save_pretrained`` (service/models/demo/families.py); one expert is re-saved sharded with an index, as the
14B checkpoints are published. diffusers' ``WanPipeline`` / ``WanImageToVideoPipeline``
``from_pretrained`` runs it resident with the same CPU generator, the image loaded by
diffusers' ``load_image``; dloserve's frames must be bitwise equal: resident, layerwise
DP1 (AllGather N=1, rank-local) and on two spawned gloo ranks (AllGather DP2, the request
on either rank while the other replays its gathers; rank-local DP2).
"""

from __future__ import annotations

import hashlib
import io
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from loadtest.ranks import run_ranks
from service.config import EngineConfig, ModelConfig, OffloadConfig, OffloadMode
from service.models.demo import write_demo_model
from service.models.pipeline import PipelineRunner
from service.models.request import GenerationRequest, RequestError
from service.models.video import to_uint8
from tests.models.aligned import aligned_denoisers


def _png() -> bytes:
    """A seeded 56x40 RGB PNG: another size and aspect than the video, so it is resized."""
    from PIL import Image

    pixels = (np.random.default_rng(7).random((40, 56, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


IMAGE = _png()
BASE = dict(prompt="a blue bird flying over the sea", negative_prompt="city night", seed=3, height=32,
            width=32, num_frames=5, num_inference_steps=3, guidance_scale=4.0)
# preset -> (pipeline class diffusers runs, the request)
CASES = {
    "wan-i2v-tiny": ("WanImageToVideoPipeline", GenerationRequest(**BASE, image=IMAGE)),
    "wan22-t2v-tiny": ("WanPipeline", GenerationRequest(**BASE, extra={"guidance_scale_2": 2.5})),
    "wan22-i2v-tiny": ("WanImageToVideoPipeline",
                       GenerationRequest(**BASE, image=IMAGE, extra={"guidance_scale_2": 2.5})),
    "wan22-ti2v-tiny": ("WanImageToVideoPipeline", GenerationRequest(**{**BASE, "width": 64}, image=IMAGE)),
    "wan22-ti2v-tiny/text": ("WanPipeline", GenerationRequest(**{**BASE, "width": 64})),
}


def sha(frames: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(frames).tobytes()).hexdigest()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    out = {}
    for preset in {c.split("/")[0] for c in CASES}:
        path = write_demo_model(root / preset, preset, seed=11)
        # re-save the last expert sharded: diffusion_pytorch_model-0000k-of-0000n + index
        from diffusers import WanTransformer3DModel

        name = "transformer_2" if (path / "transformer_2").is_dir() else "transformer"
        module = WanTransformer3DModel.from_pretrained(path / name)
        shutil.rmtree(path / name)
        module.save_pretrained(path / name, max_shard_size="60KB")
        assert (path / name / "diffusion_pytorch_model.safetensors.index.json").is_file()
        out[preset] = path
    return out


def _reference(path: Path, pipeline: str, req: GenerationRequest, image_file: Path) -> np.ndarray:
    import diffusers
    from diffusers.utils import load_image

    pipe = aligned_denoisers(getattr(diffusers, pipeline).from_pretrained(path))
    pipe.set_progress_bar_config(disable=True)
    kwargs = {"image": load_image(str(image_file))} if req.image is not None else {}
    if "guidance_scale_2" in req.extra:
        kwargs["guidance_scale_2"] = req.extra["guidance_scale_2"]
    out = pipe(prompt=req.prompt, negative_prompt=req.negative_prompt, height=req.height, width=req.width,
               num_frames=req.num_frames, num_inference_steps=req.num_inference_steps,
               guidance_scale=req.guidance_scale, generator=torch.Generator().manual_seed(req.seed),
               output_type="np", **kwargs)
    return to_uint8(np.asarray(out.frames[0]))


def _ranks(rank: int, world: int, cases: dict[str, tuple[str, GenerationRequest]]) -> dict:
    """For every case: AllGather DP2 with the request on rank 0 then on rank 1; rank-local DP2.
    One spawn for all families (starting processes is most of the time on 2 cores)."""
    out: dict = {}
    for case, (path, req) in cases.items():
        for mode in (OffloadMode.ALLGATHER, OffloadMode.RANK_LOCAL):
            runner = PipelineRunner.load(path, "cpu", config=EngineConfig(offload=OffloadConfig(mode)),
                                         group=dist.group.WORLD)
            shas = []
            for runs in (0, 1):
                if rank == runs:
                    shas.append(sha(runner.frames(req)))
                else:
                    runner.idle(req)
            out[case, mode.value] = {"shas": shas, "stats": runner.offload_stats()}
            runner.close()
    return out


@pytest.fixture(scope="module")
def spawned(models: dict[str, Path]) -> list[dict]:
    cases = {c: (str(models[c.split("/")[0]]), req) for c, (_, req) in CASES.items()}
    return run_ranks(_ranks, 2, cases, timeout=900)


@pytest.mark.e2e  # every family, resident + spawned DP2 against diffusers (make e2e)
@pytest.mark.parametrize("case", list(CASES))
def test_frames_equal_diffusers_pipeline(case: str, models: dict[str, Path], spawned: list[dict],
                                         tmp_path: Path) -> None:
    pipeline, req = CASES[case]
    path = models[case.split("/")[0]]
    image_file = tmp_path / "image.png"
    image_file.write_bytes(IMAGE)
    want = _reference(path, pipeline, req, image_file)
    assert want.std() > 0
    for settings in (None, EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER)),
                     EngineConfig(offload=OffloadConfig(OffloadMode.RANK_LOCAL))):
        runner = PipelineRunner.load(path, "cpu", config=settings)
        try:
            got = runner.frames(req)
            assert got.shape == (req.num_frames, req.height, req.width, 3)
            assert np.array_equal(got, want), (case, settings)
            if runner.handle is not None and len(runner.adapter.experts) > 1:
                st = runner.offload_stats()
                plan = runner.adapter.expert_plan(req)
                assert 0 in plan and 1 in plan  # the request switches experts
                assert st["expert_forwards"] == [plan.count(0), plan.count(1)]
                assert st["prefetch_redirects"] == 0  # the switch was prefetched
        finally:
            runner.close()
    for rank, res in enumerate(spawned):
        for mode in ("allgather", "rank-local"):
            r = res[case, mode]
            assert r["shas"] == [sha(want)], (case, mode, rank)
            assert r["stats"]["forwards"] == req.forwards()
            assert r["stats"]["idle_forwards"] == req.forwards()
    gathered = {res[case, "allgather"]["stats"]["gathered_bytes"] for res in spawned}
    assert len(gathered) == 1 and gathered.pop() > 0


def test_what_each_family_accepts(models: dict[str, Path]) -> None:
    from service.models.registry import load_adapter

    cards = {p: load_adapter(path).card() for p, path in models.items()}
    assert cards["wan-i2v-tiny"]["family"] == "wan-i2v" and cards["wan-i2v-tiny"]["image_input"] == "required"
    assert cards["wan22-t2v-tiny"]["experts"] == ["transformer", "transformer_2"]
    assert cards["wan22-t2v-tiny"]["image_input"] == "none"
    assert cards["wan22-i2v-tiny"]["family"] == "wan22-i2v" and len(cards["wan22-i2v-tiny"]["experts"]) == 2
    assert cards["wan22-ti2v-tiny"]["tasks"] == ["t2v", "i2v"]
    text = GenerationRequest(**BASE)
    with pytest.raises(RequestError, match="image is required") as e:
        load_adapter(models["wan22-i2v-tiny"]).validate(text)
    assert e.value.field == "image"
    with pytest.raises(RequestError, match="takes no image") as e:
        load_adapter(models["wan22-t2v-tiny"]).validate(GenerationRequest(**BASE, image=IMAGE))
    assert e.value.field == "image"
    with pytest.raises(RequestError, match="multiple of 32"):
        load_adapter(models["wan22-ti2v-tiny"]).validate(GenerationRequest(**{**BASE, "width": 48}))
    # a LoRA on a two-expert model: refused naming the field, not hooked onto one expert only
    from service.models.lora_ref import LoraRef

    with pytest.raises(RequestError, match="two-expert model") as e:
        load_adapter(models["wan22-t2v-tiny"]).validate(GenerationRequest(**BASE, loras=(LoraRef("x"),)))
    assert e.value.field == "loras"


@pytest.mark.parametrize("case", ["wan-i2v-tiny", "wan22-i2v-tiny", "wan22-ti2v-tiny"])
def test_cfg_in_one_forward_per_family(case: str) -> None:
    """``--cfg-batch on`` for the image families too: the image context (CLIP), the image
    latents beside the noise and TI2V's per-token timesteps are repeated for the second row.
    One forward per step, frames within 1/255 of the two-call run (as for Wan T2V)."""
    from service.config import EngineConfig, OffloadConfig, OffloadMode
    from service.models.demo import ensure_demo_model

    model = str(ensure_demo_model(case))
    req = CASES[case][1]
    frames = {}
    for batch in ("on", "off"):
        runner = PipelineRunner.load(model, "cpu",
                                     config=EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER),
                                                         model=ModelConfig(cfg_batch=batch)))
        try:
            frames[batch] = runner.frames(req).astype(int)
            per_step = 1 if batch == "on" else 2
            assert runner.offload_stats()["forwards"] == per_step * req.num_inference_steps
        finally:
            runner.close()
    assert np.abs(frames["on"] - frames["off"]).max() <= 1
