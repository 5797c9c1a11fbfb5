"""Text encoder streamed and VAE staged: the same embeddings and the same MP4 bytes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from service.config import EngineConfig, OffloadConfig, OffloadMode
from service.models.components import load_streamed_text_encoder, parse_components
from service.models.demo import ensure_demo_model
from service.models.pipeline import PipelineRunner
from service.models.request import GenerationRequest
from service.offload.staged import StagedModule

REQ = GenerationRequest(prompt="a red fox running through snow", seed=11)  # CFG on: 2 encodes


@pytest.fixture(scope="module")
def model() -> Path:
    return ensure_demo_model()


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 60, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    return ids, mask


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_streamed_text_encoder_embeddings_are_bitwise_equal(model: Path, tmp_path: Path,
                                                            dtype: torch.dtype | None) -> None:
    from transformers import UMT5EncoderModel

    folder = model / "text_encoder"
    if dtype is not None:  # a bf16 checkpoint: from_pretrained's dtype rules must be matched
        folder = tmp_path / "te"
        UMT5EncoderModel.from_pretrained(model / "text_encoder").to(dtype).save_pretrained(folder)
    ref = UMT5EncoderModel.from_pretrained(folder).eval()
    streamed, handle = load_streamed_text_encoder(UMT5EncoderModel, folder, torch.device("cpu"),
                                                  ("encoder.block",))
    ids, mask = _ids()
    with torch.inference_mode():
        want = ref(ids, mask).last_hidden_state
        got = [streamed(ids, mask).last_hidden_state for _ in range(2)]  # twice: the ring restarts
    ref_dtypes = {k: v.dtype for k, v in ref.state_dict().items()}
    assert {k: v.dtype for k, v in streamed.state_dict().items() if v.numel()} == \
        {k: ref_dtypes[k] for k, v in streamed.state_dict().items() if v.numel()}
    for g in got:
        assert g.dtype == want.dtype and torch.equal(g, want)
    st = handle.stats()
    assert st.forwards == 2 and st.rank_local_source == "pack"
    assert all(s.numel() == 0 for s in handle.slots)  # slots exist only while it runs
    assert streamed.shared.weight.device.type == "cpu"  # the embedding stays on the host
    handle.close()


def test_mp4_bytes_unchanged_with_every_component_offloaded(model: Path) -> None:
    runs = {
        "today": EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER)),
        "all offloaded, auto, 1 resident": EngineConfig(offload=OffloadConfig(
            OffloadMode.AUTO, components=("dit", "text_encoder", "vae"), probe_shape=(32, 32, 5),
            resident_layers=1)),
    }
    digests = {}
    for name, cfg in runs.items():
        r = PipelineRunner.load(model, "cpu", config=cfg)
        try:
            digests[name] = hashlib.sha256(r.generate(REQ)).hexdigest()
            if cfg.mode is OffloadMode.AUTO:
                d = r.describe()
                assert d["mode_choice"]["mode"] in ("allgather", "rank-local")
                assert d["components"] == ["dit", "text_encoder", "vae"]
                assert r.handle is not None and r.handle.stats().resident_blocks == 1
                assert not r.adapter.staged["vae"].staged  # back on the host after decode
        finally:
            r.close()
    assert len(set(digests.values())) == 1, digests


def test_staged_module_round_trip() -> None:
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    want = {k: v.clone() for k, v in m.state_dict().items()}
    s = StagedModule(m, "cpu")
    host = dict(s.host)
    s.stage_in()
    assert s.staged and all(torch.equal(m.state_dict()[k], v) for k, v in want.items())
    s.stage_out()
    assert all(m.state_dict()[k].data_ptr() == host[k].data_ptr() for k in want)
    assert s.nbytes == sum(v.numel() * v.element_size() for v in want.values())


def test_components_option_errors_name_the_flag() -> None:
    assert parse_components("dit,vae,text_encoder") == ("dit", "text_encoder", "vae")
    with pytest.raises(ValueError, match="--dlo-components: unknown component"):
        parse_components("dit,unet")
    with pytest.raises(ValueError, match="--dlo-components: must include 'dit'"):
        parse_components("vae")
