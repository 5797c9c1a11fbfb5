"""Second family: a tiny Flux T2I pipeline (diffusers classes, save_pretrained) through
our loader matches diffusers' own FluxPipeline bitwise, resident and streamed (two block
lists in one ring), and an idle rank replays one forward per step (distilled guidance).
Cross-rank runs are covered for Wan (test_strategies); here the idle count is checked
in-process to keep the suite short.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from service.config import EngineConfig, ModelConfig, OffloadConfig, OffloadMode
from service.models.demo.parts import tokenizer as demo_tokenizer
from service.models.pipeline import PipelineRunner
from service.models.request import GenerationRequest, RequestError
from service.models.video import to_uint8
from tests.models.aligned import aligned_denoisers

REQ = GenerationRequest(prompt="a red fox", seed=5, height=32, width=48, num_frames=1,
                        num_inference_steps=3, guidance_scale=3.5, extra={"max_sequence_length": 64})


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel

    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    vocab.update({c: i + 2 for i, c in enumerate(letters)})
    vocab.update({c + "</w>": i + 28 for i, c in enumerate(letters)})
    t5_tok = demo_tokenizer()
    out = tmp_path_factory.mktemp("flux") / "pipe"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        pipe = FluxPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0),
            vae=AutoencoderKL(
                down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                block_out_channels=[8, 8], layers_per_block=1, latent_channels=16, norm_num_groups=4,
                use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
            ),
            text_encoder=CLIPTextModel(CLIPTextConfig(
                vocab_size=len(vocab), hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=77, projection_dim=32,
                bos_token_id=0, eos_token_id=1, pad_token_id=1,
            )),
            tokenizer=CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77),
            text_encoder_2=T5EncoderModel(T5Config(
                vocab_size=len(t5_tok), d_model=32, d_kv=8, d_ff=37, num_layers=1, num_heads=2,
                relative_attention_num_buckets=8,
            )),
            tokenizer_2=t5_tok,
            transformer=FluxTransformer2DModel(
                in_channels=64, num_layers=2, num_single_layers=3, attention_head_dim=16,
                num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                guidance_embeds=True, axes_dims_rope=(4, 6, 6),
            ),
        )
    pipe.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def reference(flux_dir: Path) -> np.ndarray:
    from diffusers import FluxPipeline

    pipe = aligned_denoisers(FluxPipeline.from_pretrained(flux_dir))
    pipe.set_progress_bar_config(disable=True)
    images = pipe(
        prompt=REQ.prompt, height=REQ.height, width=REQ.width, num_inference_steps=REQ.num_inference_steps,
        guidance_scale=REQ.guidance_scale, generator=torch.Generator().manual_seed(REQ.seed),
        output_type="np", max_sequence_length=64,
    ).images
    return to_uint8(np.asarray(images))


@pytest.mark.parametrize(
    "offload", [None, EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER)),
                EngineConfig(offload=OffloadConfig(OffloadMode.RANK_LOCAL))],
    ids=["resident", "allgather1", "ranklocal1"],
)
def test_flux_frames_equal_diffusers(
    flux_dir: Path, reference: np.ndarray, offload: EngineConfig | None
) -> None:
    runner = PipelineRunner.load(flux_dir, "cpu", config=offload)
    try:
        assert runner.adapter.family == "flux-t2i"
        frames = runner.frames(REQ)
        assert frames.shape == (1, 32, 48, 3) and frames.std() > 0
        assert np.array_equal(frames, reference)
        if runner.handle is not None:
            stats = runner.offload_stats()
            assert stats["blocks"] == 5  # 2 double-stream + 3 single-stream blocks
            assert stats["forwards"] == REQ.num_inference_steps == runner.adapter.forwards(REQ)
            runner.idle(REQ)  # an idle rank joins as many gathers as generate made
            assert runner.offload_stats()["idle_forwards"] == stats["forwards"]
        with pytest.raises(RequestError, match="num_frames"):
            runner.validate(GenerationRequest(prompt="a", height=32, width=32, num_frames=5))
        with pytest.raises(RequestError, match="width"):
            runner.validate(GenerationRequest(prompt="a", height=32, width=34, num_frames=1))
        with pytest.raises(RequestError, match="negative prompt"):
            runner.validate(GenerationRequest(prompt="a", negative_prompt="b", height=32, width=32,
                                              num_frames=1))
        with pytest.raises(RequestError, match="shift"):
            runner.validate(GenerationRequest(prompt="a", flow_shift=2.0, height=32, width=32, num_frames=1))
    finally:
        runner.close()


def test_flux_under_compile(flux_dir: Path, reference: np.ndarray) -> None:
    """--compile on Flux: both block classes (double- and single-stream) compiled; Flux has no
    probe inputs, so the compile happens at its first request; frames equal diffusers' (the
    CPU backend, aot_eager, runs the same kernels)."""
    runner = PipelineRunner.load(flux_dir, "cpu",
                                 config=EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER),
                                                     model=ModelConfig(compile="on")))
    try:
        assert runner.compiled is not None
        assert runner.compiled.describe()["classes"] == ["FluxSingleTransformerBlock", "FluxTransformerBlock"]
        assert np.array_equal(runner.frames(REQ), reference)
    finally:
        runner.close()
