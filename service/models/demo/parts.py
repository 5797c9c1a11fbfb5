"""The parts every demo preset is built from: Wan2.1 T2V's presets, the tokenizer, the
small components, seeded weights, and the block-by-block writers of 14B-shaped parts."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch

PRESETS: dict[str, dict[str, Any]] = {
    # CI: runs a 2-step 32x32x5 request on 2 CPU cores in about a second.
    "tiny": dict(heads=2, head_dim=16, ffn=64, text_dim=32, freq_dim=32, layers=3,
                 vae_base=16, te_layers=1, dtype=torch.float32),
    # CPU demos at 64-128 px.
    "small": dict(heads=4, head_dim=32, ffn=512, text_dim=64, freq_dim=64, layers=4,
                  vae_base=16, te_layers=2, dtype=torch.float32),
    # GPU benchmarks: Wan2.1-14B block shapes, other components small.
    "wan14b-shape": dict(heads=40, head_dim=128, ffn=13824, text_dim=4096, freq_dim=256, layers=12,
                         vae_base=16, te_layers=1, dtype=torch.bfloat16),
    "wan14b-umt5xxl": dict(heads=40, head_dim=128, ffn=13824, text_dim=4096, freq_dim=256, layers=12,
                           vae_base=16, te_layers=1, dtype=torch.bfloat16, umt5xxl=True),
}
# Wan2.1's text encoder (google/umt5-xxl's encoder), as its diffusers config gives it.
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                relative_attention_num_buckets=32, relative_attention_max_distance=128,
                feed_forward_proj="gated-gelu", dense_act_fn="gelu_new", is_gated_act=True)
WORDS = ("a the of and in on with red blue green fox cat dog bird running flying snow sea "
         "forest city night sky light slow motion close up camera video of").split()
SHARD_BYTES = 2**30  # ~one 14B block per shard: peak RAM while writing ~1 GB


def tokenizer(words: tuple[str, ...] | list[str] = WORDS) -> Any:
    """A small Unigram tokenizer of ``words`` (and single characters for the rest) built with
    ``tokenizers``, wrapped as T5TokenizerFast."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import Unigram
    from transformers import T5TokenizerFast

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [(c, -4.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-:;\"()"]
    vocab += [("▁" + w, -1.0) for w in words]
    tok = Tokenizer(Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
    ])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)]
    )
    return T5TokenizerFast(tokenizer_object=tok, extra_ids=0)


def transformer_config(p: dict[str, Any], layers: int) -> dict[str, Any]:
    return dict(patch_size=(1, 2, 2), num_attention_heads=p["heads"], attention_head_dim=p["head_dim"],
                in_channels=16, out_channels=16, text_dim=p["text_dim"], freq_dim=p["freq_dim"],
                ffn_dim=p["ffn"], num_layers=layers, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


def small_parts(p: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """Text encoder, VAE, scheduler (seeded by the caller)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    te = UMT5EncoderModel(UMT5Config(
        vocab_size=vocab_size, d_model=p["text_dim"], d_kv=8, d_ff=32, num_layers=p["te_layers"],
        num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=16,
    ))
    vae = AutoencoderKLWan(base_dim=p["vae_base"], z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    # Wan2.1's published scheduler: UniPC with flow sigmas, shift 3.0 (480p).
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                    num_train_timesteps=1000, flow_shift=3.0)
    return {"text_encoder": te, "vae": vae, "scheduler": sched}


def init_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Seeded values in a sane range: fan-in scaled weights, unit norms, zero biases."""
    dev = gen.device  # a CUDA generator writes a 14B-shaped model many times faster
    if name.endswith("scale_shift_table"):
        return (torch.randn(shape, generator=gen, device=dev) / shape[-1] ** 0.5).to("cpu", dtype)
    if len(shape) >= 2:
        fan_in = 1
        for s in shape[1:]:
            fan_in *= s
        return (torch.randn(shape, generator=gen, device=dev) / fan_in**0.5).to("cpu", dtype)
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=dtype)
    return torch.ones(shape, dtype=dtype)


def write_streamed_transformer(folder: Path, config: dict[str, Any], dtype: torch.dtype,
                                seed: int, progress: bool = False, init_device: str = "cpu") -> None:
    """Save config + sharded safetensors one block at a time (diffusers' sharded layout)."""
    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file

    from service.offload.checkpoint import serving_dtype

    from ..meta import empty_weights

    with empty_weights():
        meta = WanTransformer3DModel(**config)
    folder.mkdir(parents=True, exist_ok=True)
    meta.save_config(folder)
    keep = tuple(WanTransformer3DModel._keep_in_fp32_modules or ())
    groups: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, t in meta.state_dict().items():
        group = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else "_rest"
        groups.setdefault(group, []).append((name, tuple(t.shape)))
    gen = torch.Generator(init_device).manual_seed(seed)
    order = ["_rest"] + [g for g in groups if g != "_rest"]
    # Pack consecutive groups into shards of about SHARD_BYTES.
    shards: list[list[str]] = [[]]
    size = 0
    for g in order:
        nbytes = sum(math.prod(s) * serving_dtype(n, torch.float32, dtype, keep).itemsize
                     for n, s in groups[g])
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(g)
        size += nbytes
    weight_map: dict[str, str] = {}
    total = 0
    from tqdm import tqdm

    for i, shard in enumerate(tqdm(shards, desc="writing transformer shards", disable=not progress)):
        fname = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for g in shard:
            for name, shape in groups[g]:
                tensors[name] = init_tensor(name, shape, serving_dtype(name, torch.float32, dtype, keep), gen)
                weight_map[name] = fname
                total += tensors[name].numel() * tensors[name].element_size()
        save_file(tensors, folder / fname, metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_streamed_text_encoder(folder: Path, dtype: torch.dtype, seed: int, progress: bool,
                                 init_device: str = "cpu") -> None:
    """Replace ``folder`` with a UMT5-XXL-shaped encoder, one block per shard (bf16)."""
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import UMT5Config, UMT5EncoderModel

    from ..meta import empty_weights

    shutil.rmtree(folder)
    folder.mkdir()
    config = UMT5Config(**UMT5_XXL, dtype=dtype)
    config.save_pretrained(folder)
    with empty_weights():
        meta = UMT5EncoderModel(config)
    groups: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, t in meta.state_dict().items():
        if name == "encoder.embed_tokens.weight":
            continue  # tied to shared.weight, stored once (as save_pretrained does)
        group = ".".join(name.split(".")[:3]) if name.startswith("encoder.block.") else "_rest"
        groups.setdefault(group, []).append((name, tuple(t.shape)))
    gen = torch.Generator(init_device).manual_seed(seed + 1)
    weight_map: dict[str, str] = {}
    total = 0
    names = list(groups)
    for i, g in enumerate(tqdm(names, desc="writing text encoder shards", disable=not progress)):
        fname = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
        tensors = {n: init_tensor(n, s, dtype, gen) for n, s in groups[g]}
        for n, t in tensors.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
        save_file(tensors, folder / fname, metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
