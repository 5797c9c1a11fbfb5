"""Our loader + runner against diffusers' own WanPipeline on the same saved pipeline.

The pipeline is assembled here from diffusers/transformers classes (not by our demo
writer) and saved with diffusers' ``save_pretrained``; its transformer is re-saved
sharded (with an index), as the 14B checkpoints are published. The comparison is
bitwise (``np.array_equal``) on the uint8 frames and on the float frames: on CPU in fp32
both paths run the same kernels on the same tensors, so no tolerance is needed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from service.config import EngineConfig, ModelConfig, OffloadConfig, OffloadMode
from service.models.demo.parts import tokenizer as demo_tokenizer
from service.models.pipeline import PipelineRunner
from service.models.request import GenerationRequest
from service.models.video import decode_mp4, to_uint8
from tests.models.aligned import aligned_denoisers

REQ = GenerationRequest(
    prompt="a blue bird flying over the sea", negative_prompt="city night", seed=3,
    height=48, width=32, num_frames=9, num_inference_steps=3, guidance_scale=4.0,
)


@pytest.fixture(scope="module")
def saved_pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    out = tmp_path_factory.mktemp("wan") / "pipe"
    tok = demo_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        pipe = WanPipeline(
            tokenizer=tok,
            text_encoder=UMT5EncoderModel(UMT5Config(
                vocab_size=len(tok), d_model=24, d_kv=8, d_ff=48, num_layers=2, num_heads=3,
                relative_attention_num_buckets=8, relative_attention_max_distance=16,
            )),
            vae=AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                 temperal_downsample=[False, True, True]),
            scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
            transformer=WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=8, in_channels=16,
                out_channels=16, text_dim=24, freq_dim=16, ffn_dim=40, num_layers=4,
            ),
        )
    pipe.save_pretrained(out)
    # Re-save the transformer sharded: diffusion_pytorch_model-0000k-of-0000n + index.
    shutil.rmtree(out / "transformer")
    pipe.transformer.save_pretrained(out / "transformer", max_shard_size="40KB")
    assert (out / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert len(list((out / "transformer").glob("*.safetensors"))) > 1
    return out


@pytest.fixture(scope="module")
def diffusers_frames(saved_pipeline: Path) -> np.ndarray:
    from diffusers import WanPipeline

    pipe = aligned_denoisers(WanPipeline.from_pretrained(saved_pipeline))
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        prompt=REQ.prompt, negative_prompt=REQ.negative_prompt, height=REQ.height, width=REQ.width,
        num_frames=REQ.num_frames, num_inference_steps=REQ.num_inference_steps,
        guidance_scale=REQ.guidance_scale, generator=torch.Generator().manual_seed(REQ.seed),
        output_type="np",
    )
    return np.asarray(out.frames[0])


@pytest.mark.parametrize(
    "offload",
    [None, EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER)),
     EngineConfig(offload=OffloadConfig(OffloadMode.RANK_LOCAL))],
    ids=["resident", "allgather1", "ranklocal1"],
)
def test_frames_equal_diffusers_wanpipeline(
    saved_pipeline: Path, diffusers_frames: np.ndarray, offload: EngineConfig | None
) -> None:
    runner = PipelineRunner.load(saved_pipeline, "cpu", config=offload)
    try:
        assert type(runner.adapter._parts["scheduler"]).__name__ == "FlowMatchEulerDiscreteScheduler"
        frames = runner.frames(REQ)
        assert frames.shape == (REQ.num_frames, REQ.height, REQ.width, 3)
        assert np.array_equal(frames, to_uint8(diffusers_frames))
        assert frames.std() > 0  # not a constant video
        mp4 = runner.generate(REQ)
        decoded = decode_mp4(mp4)
        assert decoded.shape == frames.shape
        # H.264 4:2:0 is lossy and these frames are near noise: close, not equal
        # (test_video bounds the error on smooth frames tightly).
        assert np.abs(decoded.astype(int) - frames.astype(int)).mean() < 20
    finally:
        runner.close()


@pytest.mark.parametrize("mode", [None, OffloadMode.ALLGATHER], ids=["resident", "allgather1"])
def test_cfg_in_one_forward_close_to_diffusers(saved_pipeline: Path, diffusers_frames: np.ndarray,
                                               mode: OffloadMode | None) -> None:
    """``--cfg-batch on``: both rows in one batch-2 forward per step (half the forwards) and
    frames within 1/255 of diffusers' two batch-1 calls (a GEMM over twice the rows may
    round differently; the tolerance stated in docs/benchmarks.md)."""
    settings = EngineConfig(offload=OffloadConfig(mode or OffloadMode.RESIDENT),
                            model=ModelConfig(cfg_batch="on"))
    runner = PipelineRunner.load(saved_pipeline, "cpu", config=settings)
    try:
        assert runner.adapter.forwards(REQ) == REQ.num_inference_steps
        frames = runner.frames(REQ).astype(int)
        ref = to_uint8(diffusers_frames).astype(int)
        assert np.abs(frames - ref).max() <= 1
        if mode is not None:
            assert runner.offload_stats()["forwards"] == REQ.num_inference_steps
    finally:
        runner.close()


def test_cfg_batch_off_stays_bitwise(saved_pipeline: Path, diffusers_frames: np.ndarray) -> None:
    """``--cfg-batch off`` explicitly: two forwards per step, bitwise diffusers' frames."""
    runner = PipelineRunner.load(saved_pipeline, "cpu",
                                 config=EngineConfig(model=ModelConfig(cfg_batch="off")))
    try:
        assert runner.adapter.forwards(REQ) == 2 * REQ.num_inference_steps
        assert np.array_equal(runner.frames(REQ), to_uint8(diffusers_frames))
    finally:
        runner.close()
