"""The attention kernel is chosen on purpose (an exact-only order) and the one that runs is
reported: what torch's own dispatcher picks for the model's heads under that order."""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend

from service.models import attention


def test_the_report_is_torchs_own_choice(resident) -> None:  # noqa: ANN001 - PipelineRunner
    got = resident.describe()["attention"]
    heads = resident.transformer.config.num_attention_heads
    q = torch.empty(1, heads, 1024, resident.transformer.config.attention_head_dim)
    with attention.chosen():
        assert got["backend"] == SDPBackend(torch._fused_sdp_choice(q, q, q)).name.lower()
    assert got["backend"] == "flash_attention"  # cuDNN is first, but CUDA-only: the CPU falls through
    assert got["order"][0] == "cudnn_attention" and "math" in got["order"]
    assert got["heads"] == heads and got["dtype"] == "float32"
    assert "H200" in got["why"]


def test_the_reported_dtype_is_the_weights_not_the_fp32_norms() -> None:
    """A bf16 checkpoint keeps some small modules in fp32 (Wan's norms, scale_shift_table):
    the report asks torch about bf16 inputs, as the blocks compute (on the H200 a first try
    that took the first parameter's dtype reported memory-efficient attention, not cuDNN)."""
    model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 64).to(torch.bfloat16))
    model.config = {"num_attention_heads": 2, "attention_head_dim": 4}
    assert attention.report(model, torch.device("cpu"), None)["dtype"] == "bfloat16"
    assert attention.report(model, torch.device("cpu"), torch.float32)["dtype"] == "float32"
