"""The attention kernel is chosen on purpose (an exact-only order) and the one that runs is
reported: what torch's own dispatcher picks for the model's heads under that order."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.nn.attention import SDPBackend

from service.config import FlagError
from service.models import attention, fp8_attention


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


def test_an_approximate_kernel_is_refused_where_it_cannot_run(resident, demo_model: str) -> None:  # noqa: ANN001
    """--attention fp8 / int8-fp8 need CUDA, Triton and a Hopper GPU, and serve Wan only: a CPU
    server refuses them at load, naming the flag, before any weights move."""
    from service.config import EngineConfig, ModelConfig
    from service.models.pipeline import PipelineRunner

    for backend in ("fp8", "int8-fp8"):
        with pytest.raises(FlagError, match=f"--attention {backend}: it needs a CUDA GPU .*exact"):
            attention.check(backend, resident.transformer, torch.device("cpu"))
    with pytest.raises(FlagError, match="--attention fp8: it needs a CUDA GPU"):
        PipelineRunner.load(demo_model, "cpu", config=EngineConfig(model=ModelConfig(attention="fp8")))
    with pytest.raises(FlagError, match="--attention fp8: the approximate kernel serves Wan models only"):
        attention.check("fp8", torch.nn.Linear(2, 2), torch.device("cpu"))
    attention.check("exact", torch.nn.Linear(2, 2), torch.device("cpu"))  # exact serves anything


def test_the_router_sends_only_cuda_self_attention_to_the_kernel(resident) -> None:  # noqa: ANN001
    """Under chosen("fp8") Wan's dispatch is our router (one object for every request, so a
    compiled block is not retraced) and restored afterwards; CPU tensors, masks and other lengths
    go to diffusers' own dispatch, so a forward here equals the exact one bitwise."""
    from diffusers.models.transformers import transformer_wan as wan

    original = wan.dispatch_attention_fn
    with attention.chosen("fp8"):
        router = wan.dispatch_attention_fn
        assert router is not original
    with attention.chosen("fp8"):
        assert wan.dispatch_attention_fn is router
    assert wan.dispatch_attention_fn is original
    q, k, v = (torch.randn(1, 24, 2, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with attention.chosen("fp8"):
        routed = wan.dispatch_attention_fn(q, k, v)
    assert torch.equal(routed, original(q, k, v))


def test_the_kernels_quantization_round_trips() -> None:
    """The 8-bit inputs the kernel reads (plain torch, so checked here; the kernel itself is
    GPU-only, measured on an H200: docs/benchmarks.md): per-token scales that undo the
    quantization to e4m3's / int8's rounding, padded rows zero, V's channels scaled per head."""
    q, k, v = (torch.randn(2, 300, 3, 64, generator=torch.Generator().manual_seed(i)) for i in range(3))
    for int8, bound in ((False, 0.04), (True, 0.01)):
        q8, k8, vt, qs, ks, vs = fp8_attention.quantize(q, k, v, qk_int8=int8)
        assert q8.shape == (2, 3, fp8_attention.padded(300), 64)
        assert q8.dtype == (torch.int8 if int8 else fp8_attention.FP8)
        assert not qs[:, :, 300:].any() and not q8[:, :, 300:].float().any()
        back = fp8_attention.dequantize(k8, ks, 300)
        assert ((back - k).abs().mean() / k.abs().mean()).item() < bound
        scaled = fp8_attention.dequantize(q8, qs, 300, fp8_attention.LOG2E / 8)  # with the softmax scale
        assert ((scaled - q).abs().mean() / q.abs().mean()).item() < bound
    v_back = (vt.float()[..., :300] * vs[..., None]).permute(0, 3, 1, 2)
    assert ((v_back - v).abs().mean() / v.abs().mean()).item() < 0.04


def test_the_kernel_is_one_opaque_op_under_tracing() -> None:
    """What torch.compile sees of the approximate path on the GPU: the quantization as plain ops
    (for inductor to fuse) and the kernel as one custom op whose fake gives the output's shape
    and dtype, so a compiled block traces without running Triton."""
    from torch.fx.experimental.proxy_tensor import make_fx

    q = torch.randn(2, 300, 3, 64, dtype=torch.bfloat16)
    for int8 in (False, True):
        graph = make_fx(partial(fp8_attention.attend, qk_int8=int8), tracing_mode="fake")(q, q, q)
        ops = [n for n in graph.graph.nodes if n.target is torch.ops.dloserve.lowp_attention.default]
        assert len(ops) == 1
        out = ops[0].meta["val"]
        assert out.shape == q.shape and out.dtype == torch.bfloat16
