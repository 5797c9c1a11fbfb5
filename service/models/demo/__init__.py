"""Offline demo checkpoints: complete diffusers-layout Wan T2V pipelines, random weights.

(The default model is not one of these presets: it is the trained "shapes" model committed under
``weights/``; ``shapes.py`` and ``train.py`` say what it is and how it was made. The presets here are
noise, for tests and benchmarks at the real shapes.)

Nothing is downloaded. The tokenizer is a small Unigram model built with ``tokenizers``
and wrapped as transformers' T5 tokenizer (what Wan checkpoints name); the text encoder
is a tiny ``UMT5EncoderModel``; the VAE a narrow ``AutoencoderKLWan`` with Wan's real
latent layout (16 channels, 8x spatial, 4x temporal); the scheduler Wan's real UniPC
flow-matching config. ``tiny``/``small`` are saved by ``WanPipeline.save_pretrained``.

``wan14b-shape`` has the real Wan2.1-14B transformer (dim 5120 = 40 x 128, ffn 13824,
text_dim 4096) with ``layers`` blocks in bf16 (``_keep_in_fp32_modules`` in fp32): 703 MB
per block, so it is written block by block as a sharded checkpoint with an index, never
holding more than one block in memory. ``wan14b-umt5xxl`` adds the real UMT5-XXL text
encoder shapes of Wan2.1 (24 layers, d_model 4096, d_ff 10240, 64 heads, vocabulary
256,384: 11.4 GB in bf16), written the same way, so the text encoder's device memory can
be measured beside the transformer.

The other families (Wan2.1 I2V, Wan2.2 A14B T2V/I2V, TI2V-5B) have presets of their own,
written by ``families.py`` (``preset_names()`` lists every preset).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
__all__ = ["cache_dir", "ensure_demo_model", "preset_names", "write_demo_model"]
# torch and the writers load with a write: the package is also where a server finds the
# committed model (``shapes.model_dir``), and a server's front end starts without torch.


def preset_names() -> list[str]:
    """Every preset ``write_demo_model`` takes (Wan2.1 T2V's, then the other families')."""
    from .families import FAMILY_PRESETS
    from .parts import PRESETS

    return sorted(PRESETS) + sorted(FAMILY_PRESETS)


def _preset(name: str) -> dict[str, Any]:
    from .families import FAMILY_PRESETS
    from .parts import PRESETS

    if name in PRESETS:
        return PRESETS[name]
    if name in FAMILY_PRESETS:
        return FAMILY_PRESETS[name]
    raise ValueError(f"preset must be one of {preset_names()}, got {name!r}")


def write_demo_model(path: str | os.PathLike, preset: str = "tiny", layers: int | None = None,
                     seed: int = 0, progress: bool = False, init_device: str = "cpu") -> Path:
    """Write a complete Wan T2V pipeline directory at ``path`` (new or empty folder).

    ``init_device`` draws the streamed (bf16) presets' random weights there ("cuda" for
    benchmarks: same distribution, other numbers than a CPU draw).
    """
    import torch
    from diffusers import WanPipeline, WanTransformer3DModel

    from .families import write_family
    from .parts import (
        PRESETS,
        small_parts,
        tokenizer,
        transformer_config,
        write_streamed_text_encoder,
        write_streamed_transformer,
    )

    p = _preset(preset)
    n_layers = p["layers"] if layers is None else int(layers)
    if n_layers < 1:
        raise ValueError(f"layers must be >= 1, got {n_layers}")
    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: exists and is not an empty folder")
    out.mkdir(parents=True, exist_ok=True)
    if preset not in PRESETS:
        write_family(out, preset, n_layers, seed, progress, init_device)
        return _stamp(out, preset, n_layers, seed)
    tok = tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        parts = small_parts(p, len(tok))
        streamed = p["dtype"] != torch.float32
        transformer = None
        if not streamed:
            transformer = WanTransformer3DModel(**transformer_config(p, n_layers)).eval()
        pipe = WanPipeline(tokenizer=tok, transformer=transformer, **parts)
        pipe.save_pretrained(out)
    if streamed:
        write_streamed_transformer(
            out / "transformer", transformer_config(p, n_layers), p["dtype"], seed, progress, init_device
        )
        index_file = out / "model_index.json"
        index = json.loads(index_file.read_text())
        index["transformer"] = ["diffusers", "WanTransformer3DModel"]
        index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if p.get("umt5xxl"):
        write_streamed_text_encoder(out / "text_encoder", p["dtype"], seed, progress, init_device)
    return _stamp(out, preset, n_layers, seed)


def _stamp(out: Path, preset: str, layers: int, seed: int) -> Path:
    (out / "dloserve_demo.json").write_text(json.dumps(
        {"preset": preset, "layers": layers, "seed": seed, "format": FORMAT_VERSION}, indent=2) + "\n")
    return out


def cache_dir() -> Path:
    return Path(os.environ.get("DLOSERVE_CACHE") or Path.home() / ".cache" / "dloserve")


def ensure_demo_model(preset: str = "tiny", layers: int | None = None, seed: int = 0) -> Path:
    """The demo model in the cache folder, written on first use.

    Written into a temporary sibling folder and renamed into place: concurrent processes
    either win the rename or find the finished folder, never a half-written one.
    """
    n_layers = _preset(preset)["layers"] if layers is None else int(layers)
    root = cache_dir()
    final = root / f"wan-{preset}-L{n_layers}-s{seed}-v{FORMAT_VERSION}"
    if (final / "model_index.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        write_demo_model(tmp / "model", preset, n_layers, seed)
        try:
            os.rename(tmp / "model", final)
        except OSError:
            if not (final / "model_index.json").is_file():
                raise  # not a lost race: a real error
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
