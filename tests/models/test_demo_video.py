"""Demo checkpoints (presets, streamed sharded writer, cache race) and MP4 encoding."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from service.config import EngineConfig, OffloadConfig, OffloadMode
from service.models import demo
from service.models.demo import parts
from service.models.pipeline import PipelineRunner
from service.models.request import GenerationRequest
from service.models.video import decode_mp4, encode_mp4
from service.offload import Checkpoint


def test_wan14b_shape_has_the_real_block_shapes() -> None:
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    cfg = parts.transformer_config(parts.PRESETS["wan14b-shape"], 2)
    with init_empty_weights():
        m = WanTransformer3DModel(**cfg)
    assert m.config.num_attention_heads * m.config.attention_head_dim == 5120
    assert (m.config.ffn_dim, m.config.text_dim, m.config.in_channels) == (13824, 4096, 16)
    assert tuple(m.config.patch_size) == (1, 2, 2)
    keep = WanTransformer3DModel._keep_in_fp32_modules
    from service.offload.checkpoint import serving_dtype

    block = sum(
        t.numel() * serving_dtype(k, torch.float32, torch.bfloat16, keep).itemsize
        for k, t in m.state_dict().items()
        if k.startswith("blocks.0.")
    )
    assert 700e6 < block < 706e6  # the design notes' 703 MB per Wan2.1-14B block


def test_streamed_sharded_writer_loads_and_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wan14b-shape path (bf16 + fp32 keep list, shard by shard) at toy width."""
    small = dict(parts.PRESETS["tiny"], dtype=torch.bfloat16)
    monkeypatch.setitem(parts.PRESETS, "wan14b-shape", small)
    monkeypatch.setattr(parts, "SHARD_BYTES", 30_000)  # where the writer reads it
    path = demo.write_demo_model(tmp_path / "m", "wan14b-shape", layers=3, seed=5)
    folder = path / "transformer"
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    ckpt = Checkpoint(folder)
    assert ckpt.records["blocks.1.ffn.net.0.proj.weight"].dtype == torch.bfloat16
    assert ckpt.records["blocks.1.scale_shift_table"].dtype == torch.float32
    assert ckpt.records["blocks.1.norm2.weight"].dtype == torch.float32
    assert index["metadata"]["total_size"] == ckpt.nbytes
    ckpt.close()
    assert json.loads((path / "model_index.json").read_text())["transformer"] == [
        "diffusers", "WanTransformer3DModel"
    ]
    runner = PipelineRunner.load(path, "cpu",
                                 config=EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER)))
    try:
        frames = runner.frames(GenerationRequest(prompt="a fox", num_inference_steps=1))
        assert frames.shape == (5, 32, 32, 3) and frames.std() > 0
    finally:
        runner.close()


def test_ensure_demo_model_race(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLOSERVE_CACHE", str(tmp_path))
    got: list[Path] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            got.append(demo.ensure_demo_model("tiny", layers=1, seed=3))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(got) == 2 and got[0] == got[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [got[0].name]  # no temp leftovers
    assert json.loads((got[0] / "dloserve_demo.json").read_text())["layers"] == 1
    assert demo.ensure_demo_model("tiny", layers=1, seed=3) == got[0]


def test_write_demo_model_refuses_a_full_folder(tmp_path: Path) -> None:
    (tmp_path / "x").write_text("keep me")
    with pytest.raises(FileExistsError):
        demo.write_demo_model(tmp_path)
    with pytest.raises(ValueError, match="preset"):
        demo.write_demo_model(tmp_path / "new", "huge")


def _smooth(t: int, h: int, w: int) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    frames = [np.stack([x * 4 + i * 8, y * 4, (x + y) * 2], -1) for i in range(t)]
    return np.clip(np.array(frames), 0, 255).astype(np.uint8)


def test_mp4_is_deterministic_and_faithful() -> None:
    frames = _smooth(5, 32, 48)
    a, b = encode_mp4(frames, 8), encode_mp4(frames.copy(), 8)
    assert a == b
    assert a[4:8] == b"ftyp" and a.find(b"moov") < a.find(b"mdat")  # +faststart
    assert encode_mp4(frames, 16) != a
    decoded = decode_mp4(a)
    assert decoded.shape == frames.shape
    assert np.abs(decoded.astype(int) - frames.astype(int)).mean() < 3


def test_mp4_odd_sizes_and_bad_input() -> None:
    decoded = decode_mp4(encode_mp4(_smooth(3, 31, 17), 8))
    assert decoded.shape == (3, 32, 18, 3)  # padded to even sides by edge repeat
    with pytest.raises(ValueError, match="uint8"):
        encode_mp4(np.zeros((2, 8, 8, 3), dtype=np.float32), 8)
    with pytest.raises(ValueError, match="fps"):
        encode_mp4(np.zeros((2, 8, 8, 3), dtype=np.uint8), 0)
