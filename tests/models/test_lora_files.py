"""Adapter files read as diffusers reads them, and bad ones refused naming adapter and key.

The files are real safetensors: the PEFT layout written by diffusers' own
``WanPipeline.save_lora_weights`` (with its metadata header), the original-Wan/lightx2v
layout that ``load_lora_weights`` converts, and hand-broken variants of both.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from service.models.demo.lora import write_demo_lora
from service.models.lora import Targets, read_adapter, targets_of
from service.models.lora_ref import LoraError
from service.models.registry import load_adapter


@pytest.fixture(scope="module")
def targets(demo_model: str) -> Targets:
    return targets_of(load_adapter(demo_model))


@pytest.fixture(scope="module")
def peft_file(demo_model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_lora(demo_model, tmp_path_factory.mktemp("lora") / "style.safetensors", rank=4, alpha=8)


def test_peft_layout(peft_file: Path, targets: Targets) -> None:
    raw = load_file(peft_file)
    assert all(k.startswith("transformer.") and ".lora_" in k for k in raw)
    a = read_adapter(peft_file, "style", targets)
    assert a.layout == "peft" and set(a.layers) == {k[len("transformer."):-len(".lora_A.weight")]
                                                   for k in raw if k.endswith(".lora_A.weight")}
    f = a.layers["blocks.0.attn1.to_q"]
    assert torch.equal(f.down, raw["transformer.blocks.0.attn1.to_q.lora_A.weight"])
    assert (f.rank, f.alpha) == (4, 8) and f.scaling(0.5) == 0.5 * 8 / 4
    assert a.nbytes == sum(4 * (t.numel()) for t in raw.values())  # fp32 model: fp32 factors
    assert len(a.sha256) == 64


def test_wan_layout_converted_as_diffusers_does(demo_model: str, targets: Targets, tmp_path: Path) -> None:
    from diffusers import WanPipeline

    path = write_demo_lora(demo_model, tmp_path / "lightx2v.safetensors", layout="kohya", rank=4, alpha=2)
    assert any(k.startswith("diffusion_model.") and k.endswith(".diff_b") for k in load_file(path))
    a = read_adapter(path, "distill", targets)
    state = WanPipeline.lora_state_dict(str(path))
    assert a.layout == "wan"
    for name, f in a.layers.items():
        assert torch.equal(f.down, state[f"transformer.{name}.lora_A.weight"])  # alpha/rank folded in
        assert torch.equal(f.bias, state[f"transformer.{name}.lora_B.bias"])
        assert f.alpha == f.rank == 4  # no metadata: lora_alpha = r, as PEFT's config gets it


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file(tensors, path)
    return path


def _bad(tmp: Path, base: Path, edit) -> Path:  # noqa: ANN001 - a dict -> None function
    t = load_file(base)
    edit(t)
    return _write(tmp / "bad.safetensors", t)


Q = "transformer.blocks.0.attn1.to_q"


@pytest.mark.parametrize(
    ("case", "key", "message"),
    [
        ("shape", f"{Q}.lora_A.weight", "does not fit this model"),
        ("unknown", "transformer.blocks.99.attn1.to_q.lora_A.weight", "has no module"),
        ("family", "transformer.transformer_blocks.0.attn.to_q.lora_A.weight", "has no module"),
        ("norm", "transformer.blocks.0.norm2.lora_A.weight", "Linear layers only"),
        ("missing", f"{Q}.lora_B.weight", "needs both factors"),
        ("foreign", "text_encoder.layer.lora_A.weight", "not a key of a wan-t2v LoRA layout"),
        ("not-lora", f"{Q}.weight", "not a LoRA factor"),
        ("int", f"{Q}.lora_B.weight", "not a floating-point"),
    ],
)
def test_bad_adapters_name_the_key(peft_file: Path, targets: Targets, tmp_path: Path,
                                   case: str, key: str, message: str) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        a, b = t[f"{Q}.lora_A.weight"], t[f"{Q}.lora_B.weight"]
        if case == "shape":
            t[f"{Q}.lora_A.weight"] = torch.zeros(a.shape[0], a.shape[1] + 1)
        elif case in ("unknown", "family", "norm", "foreign"):
            stem = key[: -len(".lora_A.weight")]
            t[f"{stem}.lora_A.weight"], t[f"{stem}.lora_B.weight"] = a.clone(), b.clone()
        elif case == "missing":
            del t[f"{Q}.lora_B.weight"]
        elif case == "not-lora":
            t[f"{Q}.weight"] = torch.zeros(1)
        elif case == "int":
            t[f"{Q}.lora_B.weight"] = b.to(torch.int32)

    path = _bad(tmp_path, peft_file, edit)
    with pytest.raises(LoraError) as e:
        read_adapter(path, "bad-one", targets)
    assert e.value.adapter == "bad-one" and e.value.key == key, str(e.value)
    assert message in str(e.value) and "'bad-one'" in str(e.value)


def test_unreadable_files(peft_file: Path, targets: Targets, tmp_path: Path) -> None:
    data = peft_file.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) // 2])
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    for path in (truncated, garbage, tmp_path / "absent.safetensors"):
        with pytest.raises(LoraError) as e:
            read_adapter(path, "c", targets)
        assert e.value.key == "file" and e.value.adapter == "c"
    other = _write(tmp_path / "sd.safetensors", {"lora_te_text_model.x.lora_down.weight": torch.zeros(2, 2)})
    with pytest.raises(LoraError, match="not a key of a wan-t2v LoRA layout") as e:
        read_adapter(other, "sd", targets)
    assert e.value.key == "lora_te_text_model.x.lora_down.weight"


def test_changed_file_refused(peft_file: Path, targets: Targets, tmp_path: Path) -> None:
    first = read_adapter(peft_file, "s", targets)
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(peft_file.read_bytes())
    assert read_adapter(copy, "s", targets, sha256=first.sha256).sha256 == first.sha256
    _bad(tmp_path, peft_file, lambda t: t.update({f"{Q}.lora_A.weight": t[f"{Q}.lora_A.weight"] * 2}))
    with pytest.raises(LoraError, match="changed since it was registered"):
        read_adapter(tmp_path / "bad.safetensors", "s", targets, sha256=first.sha256)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_factors_are_refused_naming_the_key(peft_file: Path, targets: Targets, tmp_path: Path,
                                                       value: float) -> None:
    """NaN/Inf weights used to register and give all-black videos marked completed."""
    def edit(t: dict[str, torch.Tensor]) -> None:
        t[f"{Q}.lora_B.weight"] = t[f"{Q}.lora_B.weight"].clone()
        t[f"{Q}.lora_B.weight"][0, 0] = value

    with pytest.raises(LoraError, match="NaN|Inf") as e:
        read_adapter(_bad(tmp_path, peft_file, edit), "nan", targets)
    assert e.value.key == f"{Q}.lora_B.weight"


@pytest.mark.parametrize(("alpha", "message"), [
    (float("nan"), "finite number > 0"), (float("inf"), "finite number > 0"), (-1e6, "finite number > 0"),
    (0, "finite number > 0"), ("8", "must be a number"), (1e308, "past torch.float32's range"),
])
def test_bad_lora_alpha_in_the_metadata_is_refused(demo_model: str, targets: Targets, tmp_path: Path,
                                                   alpha: object, message: str) -> None:
    """The header's ``lora_alpha`` (diffusers' own metadata, as a training script saves it):
    a NaN, negative, huge or string one is refused at registration, naming it."""
    path = write_demo_lora(demo_model, tmp_path / "a.safetensors", rank=4, alpha=alpha)  # type: ignore[arg-type]
    with pytest.raises(LoraError) as e:
        read_adapter(path, "alpha", targets)
    assert e.value.key in ("lora_alpha", "metadata") and message in str(e.value), str(e.value)


def test_a_fifo_is_refused_at_once(targets: Targets, tmp_path: Path) -> None:
    """A FIFO (or a device) is never opened for reading: it would block the reader forever."""
    import os

    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(LoraError, match="a FIFO: adapters must be regular files") as e:
        read_adapter(fifo, "pipe", targets)
    assert e.value.key == "file"
    with pytest.raises(LoraError, match="a character device"):
        read_adapter("/dev/zero", "dev", targets)
