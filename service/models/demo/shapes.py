"""The trained demo model ("shapes"): a small Wan2.1 T2V pipeline that draws what its prompt says.

Trained here (``train.py``) on the drawn clips of ``clips.py``: one circle, square or triangle
of one colour moving left, right, up or down, or standing still, on a black, white or gray
background. The folder is committed (``weights/wan-shapes``, written by
``WanPipeline.save_pretrained``) with its training log, so ``make serve``, ``generate`` and the
playground make a video a person can check against its prompt, and every setting that changes
numbers can be scored (``score.py``). The noise presets (``tiny``, ``wan14b-shape``, ...) stay for
tests and benchmarks at the Wan-14B shapes.

Its parts are the real diffusers and transformers classes: ``WanTransformer3DModel`` (4 blocks,
3 heads of 64), ``AutoencoderKLWan`` (Wan's latent layout: 16 channels, 8x spatial, 4x temporal;
latent statistics measured on the training clips), a frozen, randomly initialised
``UMT5EncoderModel`` with a tokenizer of the prompts' words, and Wan's UniPC scheduler.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

NAME = "wan-shapes"
WEIGHTS = Path(__file__).parent / "weights"
# The words of every prompt (clips.py), then a few more that people type.
VOCAB = ("a an the on in of with and moving standing still left right up down circle square triangle "
         "red green blue yellow white black gray grey background ball box").split()
TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=64, in_channels=16,
                   out_channels=16, text_dim=64, freq_dim=64, ffn_dim=768, num_layers=4, cross_attn_norm=True,
                   qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
VAE = dict(base_dim=16, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
           temperal_downsample=[False, True, True])
TEXT = dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
            relative_attention_max_distance=16)
# The request it was trained for (the service's and ``generate``'s defaults with this model).
REQUEST = dict(width=64, height=64, num_frames=17, fps=8, num_inference_steps=20, guidance_scale=4.0)


def model_dir() -> Path:
    """The committed, trained pipeline folder."""
    return WEIGHTS / NAME


def write_untrained(path: str | os.PathLike, seed: int = 0) -> Path:
    """The pipeline of the trained model's shapes with seeded random weights (training starts here)."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from .parts import tokenizer

    out = Path(path)
    tok = tokenizer(VOCAB)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        parts: dict[str, Any] = dict(
            tokenizer=tok,
            text_encoder=UMT5EncoderModel(UMT5Config(vocab_size=len(tok), **TEXT)).eval(),
            vae=AutoencoderKLWan(**VAE).eval(),
            transformer=WanTransformer3DModel(**TRANSFORMER).eval(),
            scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                              num_train_timesteps=1000, flow_shift=3.0),
        )
    WanPipeline(**parts).save_pretrained(out)
    return out
