"""The device bytes a streamed transformer may take (``automode.device_budget``): a budget in
GiB as given, else the default share of a CUDA device's memory, else none (every block
streams). The GPU's size is the one thing here that needs a GPU: its query is stood in for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from service.config import OffloadConfig, OffloadMode
from service.config.offload import DEVICE_SHARE
from service.models.automode import device_budget

GPU = 140 * 2**30


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(total_memory=GPU))
    return torch.device("cuda", 0)


def test_a_share_of_the_gpu_by_default(one_gpu: torch.device) -> None:
    off = OffloadConfig(OffloadMode.AUTO)
    assert off.device_share == DEVICE_SHARE
    assert device_budget(off, one_gpu) == (int(DEVICE_SHARE * GPU), True)
    quarter = OffloadConfig(OffloadMode.RANK_LOCAL, device_share=0.25)
    assert device_budget(quarter, one_gpu) == (int(0.25 * GPU), True)


def test_what_the_user_placed_wins(one_gpu: torch.device) -> None:
    given = OffloadConfig(OffloadMode.AUTO, device_memory_gb=30.0)
    assert device_budget(given, one_gpu) == (30 * 2**30, False)
    assert device_budget(OffloadConfig(OffloadMode.AUTO, resident_layers=0), one_gpu) == (None, False)
    assert device_budget(OffloadConfig(OffloadMode.AUTO, device_share=0.0), one_gpu) == (None, False)


def test_no_share_off_cuda_or_under_sequence_parallelism(one_gpu: torch.device) -> None:
    off = OffloadConfig(OffloadMode.AUTO)
    assert device_budget(off, torch.device("cpu")) == (None, False)  # CPU: every block streams, as before
    assert device_budget(off, one_gpu, sequence_parallel=2) == (None, False)


def test_the_share_is_checked() -> None:
    from service.config import FlagError

    for bad in (-0.1, 1.0, 2.0):
        with pytest.raises(FlagError, match="--dlo-device-share"):
            OffloadConfig(OffloadMode.AUTO, device_share=bad)
