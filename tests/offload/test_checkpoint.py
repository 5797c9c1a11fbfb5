"""Checkpoint errors name the key or file; sharded folders load like single files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from service.offload import CheckpointError, enable_layerwise_offload, load_resident
from service.offload.checkpoint import Checkpoint

from .toy import empty_model, make_checkpoint


@pytest.fixture()
def state(tmp_path: Path) -> dict[str, torch.Tensor]:
    path = tmp_path / "full.safetensors"
    make_checkpoint(str(path))
    ck = Checkpoint(path)
    return {k: ck.view(k).clone() for k in ck.records}


def test_missing_key(tmp_path: Path, state: dict) -> None:
    del state["blocks.3.fc2.weight"]
    save_file(state, tmp_path / "m.safetensors")
    with pytest.raises(CheckpointError, match=r"missing keys \['blocks.3.fc2.weight'\]"):
        enable_layerwise_offload(empty_model(), tmp_path / "m.safetensors", device="cpu")


def test_unexpected_key(tmp_path: Path, state: dict) -> None:
    state["blocks.9.extra"] = torch.zeros(3)
    save_file(state, tmp_path / "m.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected keys \['blocks.9.extra'\]"):
        load_resident(empty_model(), tmp_path / "m.safetensors")


def test_shape_mismatch(tmp_path: Path, state: dict) -> None:
    state["head.weight"] = torch.zeros(16, 65, dtype=torch.bfloat16)
    save_file(state, tmp_path / "m.safetensors")
    with pytest.raises(CheckpointError, match=r"key 'head.weight' in m.safetensors has shape \[16, 65\]"):
        enable_layerwise_offload(empty_model(), tmp_path / "m.safetensors", device="cpu")


def test_dtype_kind_mismatch(tmp_path: Path, state: dict) -> None:
    state["embed.bias"] = torch.zeros(64, dtype=torch.int32)
    save_file(state, tmp_path / "m.safetensors")
    with pytest.raises(CheckpointError, match=r"key 'embed.bias' .* dtype torch.int32"):
        enable_layerwise_offload(empty_model(), tmp_path / "m.safetensors", device="cpu")


def test_truncated_file(tmp_path: Path, state: dict) -> None:
    path = tmp_path / "t.safetensors"
    save_file(state, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"t.safetensors: key '.*' ends at byte \d+ .* truncated"):
        enable_layerwise_offload(empty_model(), path, device="cpu")
    path.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="t.safetensors: file is too short"):
        Checkpoint(path)


def test_corrupt_header(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    path.write_bytes((20).to_bytes(8, "little") + b"{not json at all!!!}" + b"\0" * 64)
    with pytest.raises(CheckpointError, match="c.safetensors: cannot read safetensors header"):
        Checkpoint(path)


def _write_sharded(folder: Path, state: dict) -> None:
    keys = sorted(state)
    half = len(keys) // 2
    parts = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    weight_map = {}
    for name, ks in parts.items():
        save_file({k: state[k] for k in ks}, folder / name)
        weight_map.update({k: name for k in ks})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_sharded_folder_loads(tmp_path: Path, state: dict) -> None:
    folder = tmp_path / "sharded"
    folder.mkdir()
    _write_sharded(folder, state)
    single = tmp_path / "single.safetensors"
    save_file(state, single)
    x = torch.randn(2, 5, 16)
    ref = load_resident(empty_model(), single)
    model = empty_model()
    handle = enable_layerwise_offload(model, folder, device="cpu")
    with torch.inference_mode():
        assert torch.equal(model(x), ref(x))
    handle.close()


def test_sharded_folder_missing_shard(tmp_path: Path, state: dict) -> None:
    _write_sharded(tmp_path, state)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: shard named in"):
        Checkpoint(tmp_path)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="nope: checkpoint path does not exist"):
        Checkpoint(tmp_path / "nope")


def test_meta_non_persistent_buffer_is_named(tmp_path: Path, state: dict) -> None:
    save_file(state, tmp_path / "m.safetensors")
    with torch.device("meta"):
        from .toy import ToyDiT

        model = ToyDiT()
    with pytest.raises(CheckpointError, match="buffer 'freqs' is not saved"):
        load_resident(model, tmp_path / "m.safetensors")


def test_views_are_zero_copy_and_read_only(tmp_path: Path, state: dict) -> None:
    save_file(state, tmp_path / "m.safetensors")
    ck = Checkpoint(tmp_path / "m.safetensors")
    a, b = ck.view("head.weight"), ck.view("head.weight")
    assert a.data_ptr() == b.data_ptr()  # the same mapped pages, no copy
    assert torch.equal(a, state["head.weight"])
