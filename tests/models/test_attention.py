"""The attention kernel is chosen on purpose (an exact-only order) and the one that runs is
reported: what torch's own dispatcher picks for the model's heads under that order."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

from service.config import FlagError
from service.models import attention


def test_the_report_is_torchs_own_choice(resident) -> None:  # noqa: ANN001 - PipelineRunner
    got = resident.describe()["attention"]
    heads = resident.transformer.config.num_attention_heads
    q = torch.empty(1, heads, 1024, resident.transformer.config.attention_head_dim)
    with attention.chosen():
        assert got["backend"] == SDPBackend(torch._fused_sdp_choice(q, q, q)).name.lower()
    assert got["backend"] == got["cross_attention"] == got["sdpa"] == "flash_attention"  # cuDNN: CUDA only
    assert got["order"][0] == "cudnn_attention" and "math" in got["order"]
    assert got["heads"] == heads and got["dtype"] == "float32"
    assert "H200" in got["why"]
    # exact tries flash-attn-4 only on a CUDA sm90 GPU: here SDPA, and the report says why
    why = "flash-attn-4 not tried: flash-attn-4 needs a CUDA GPU (this server computes on cpu)"
    assert got["why"].endswith("; " + why)
    assert got["routes"] == {"source": "rule", "default": "sdpa", "why": why, "routes": []}


def test_the_reported_dtype_is_the_weights_not_the_fp32_norms() -> None:
    """A bf16 checkpoint keeps some small modules in fp32 (Wan's norms, scale_shift_table):
    the report asks torch about bf16 inputs, as the blocks compute (on the H200 a first try
    that took the first parameter's dtype reported memory-efficient attention, not cuDNN)."""
    model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 64).to(torch.bfloat16))
    model.config = {"num_attention_heads": 2, "attention_head_dim": 4}
    assert attention.report(model, torch.device("cpu"), None)["dtype"] == "bfloat16"
    assert attention.report(model, torch.device("cpu"), torch.float32)["dtype"] == "float32"


def test_a_kernel_that_cannot_run_is_refused_naming_the_flag(resident, demo_model: str) -> None:  # noqa: ANN001
    """--attention fa4 / fp8 need CUDA on sm90 (and the gpu extra) and
    serve Wan only: a CPU server refuses them at load, naming the flag, before any weights move;
    exact and sdpa serve anything (exact falls back to SDPA and says why)."""
    from service.config import EngineConfig, ModelConfig
    from service.models.pipeline import PipelineRunner

    cudnn = r"cuDNN's FP8 attention \(nvidia-cudnn-frontend\)"
    for backend, what in (("fa4", "flash-attn-4"), ("fp8", cudnn)):
        with pytest.raises(FlagError, match=f"--attention {backend}: {what} needs a CUDA GPU "
                                            r"\(this server computes on cpu\); use --attention exact"):
            attention.check(backend, resident.transformer, torch.device("cpu"))
        with pytest.raises(FlagError, match=f"--attention {backend}: serves Wan models only"):
            attention.check(backend, torch.nn.Linear(2, 2), torch.device("cpu"))
    with pytest.raises(FlagError, match="--attention fp8: cuDNN's FP8 attention .* needs a CUDA GPU"):
        PipelineRunner.load(demo_model, "cpu", config=EngineConfig(model=ModelConfig(attention="fp8")))
    for exact in ("exact", "sdpa"):
        attention.check(exact, torch.nn.Linear(2, 2), torch.device("cpu"))


def test_a_float32_model_is_refused_the_half_precision_kernels(resident) -> None:  # noqa: ANN001
    """fa4 and cuDNN's FP8 take bf16/fp16 only; the router hands anything else to SDPA, so a
    float32 model served under --attention fp8 ran SDPA while its report named cuDNN's FP8 (the
    trained demo model on an H200, 2026-12-05: frames bit-identical to exact). Refused instead,
    naming the flag and the dtype, before the device is asked about (so a CPU checks it too)."""
    for backend in ("fa4", "fp8"):
        with pytest.raises(FlagError, match=f"--attention {backend}: the kernel takes bfloat16 or float16, "
                                            r"this model computes in float32 \(--dtype bfloat16"):
            attention.check(backend, resident.transformer, torch.device("cpu"), torch.float32)
        with pytest.raises(FlagError, match="needs a CUDA GPU"):  # half precision: the device decides
            attention.check(backend, resident.transformer, torch.device("cpu"), torch.bfloat16)
        with pytest.raises(FlagError, match="computes in float32"):  # the report checks the model's dtype
            attention.report(resident.transformer, torch.device("cpu"), None, backend)


def test_sdpa_and_fa4_force_their_routes() -> None:
    """sdpa keeps every call on SDPA, fa4 sends every call to flash-attn-4 (where it fits), whatever
    was measured; exact and the approximate ones take the measured table."""
    assert attention.routes_for("sdpa").kernels() == {"sdpa"}
    fa4 = attention.routes_for("fa4")
    assert fa4.kernels() == {"fa4"} and fa4.kernel("cross", 32760, 512, 40, 128) == "fa4"
    assert attention.routes_for("exact") is attention.routes_for("fp8")


def test_the_router_sends_only_cuda_calls_to_other_kernels(resident) -> None:  # noqa: ANN001
    """Under chosen("fp8") or ("fa4") Wan's dispatch is our router (one object for every request,
    so a compiled block is not retraced) and restored afterwards; under exact with nothing routed
    (this CPU) it is not replaced at all. CPU tensors, masks and SP calls go to diffusers' own
    dispatch, so a forward here equals the exact one bitwise."""
    from diffusers.models.transformers import transformer_wan as wan

    original = wan.dispatch_attention_fn
    for backend in ("fp8", "fa4"):
        with attention.chosen(backend):
            router = wan.dispatch_attention_fn
            assert router is not original
        with attention.chosen(backend):
            assert wan.dispatch_attention_fn is router
        assert wan.dispatch_attention_fn is original
    for backend in ("exact", "sdpa"):
        with attention.chosen(backend):
            assert wan.dispatch_attention_fn is original
    q, k, v = (torch.randn(1, 24, 2, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    for backend in ("fp8", "fa4"):
        with attention.chosen(backend):
            routed = wan.dispatch_attention_fn(q, k, v)
        assert torch.equal(routed, original(q, k, v))


def test_the_new_kernels_are_one_opaque_op_each_under_tracing() -> None:
    """cuDNN's FP8 path as torch.compile sees it: the per-tensor quantization of q, k, v (three
    amax reductions) and O's dequantization as plain ops, for inductor to fuse into the norm/RoPE
    before and the projection after, and the kernel one custom op with an FP8 output;
    flash-attn-4 one op too. No GPU runs here."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from service.models import cudnn_fp8_attention, fa4_attention

    q = torch.randn(2, 300, 3, 64, dtype=torch.bfloat16)
    graph = make_fx(cudnn_fp8_attention.attend, tracing_mode="fake")(q, q, q)
    ops = [n for n in graph.graph.nodes if n.target is torch.ops.dloserve.cudnn_fp8_attention.default]
    assert len(ops) == 1 and ops[0].meta["val"].dtype == torch.float8_e4m3fn
    assert ops[0].meta["val"].shape == q.shape
    assert len([n for n in graph.graph.nodes if n.target is torch.ops.aten.amax.default]) == 3
    out = next(n for n in graph.graph.nodes if n.op == "output").args[0]
    assert out.meta["val"].dtype == torch.bfloat16 and out.meta["val"].shape == q.shape
    k = torch.randn(2, 512, 3, 64, dtype=torch.bfloat16)
    graph = make_fx(fa4_attention.attend, tracing_mode="fake")(q, k, k)
    ops = [n for n in graph.graph.nodes if n.target is torch.ops.dloserve.fa4_attention.default]
    assert len(ops) == 1 and ops[0].meta["val"].shape == q.shape


def test_flash_attn_4_takes_only_what_it_fits() -> None:
    """The router sends a call to flash-attn-4 only where its sm90 forward takes it."""
    from service.models.fa4_attention import fits

    bf = torch.bfloat16
    q, k = torch.empty(2, 300, 3, 128, dtype=bf), torch.empty(2, 512, 3, 128, dtype=bf)
    assert fits(q, k, k)
    assert not fits(q.float(), k.float(), k.float())
    wide = torch.empty(2, 512, 3, 264, dtype=bf)
    assert not fits(torch.empty(2, 300, 3, 264, dtype=bf), wide, wide)  # head dim over 256
    assert not fits(q, torch.empty(2, 512, 4, 128, dtype=bf), k)  # heads differ
    assert not fits(q.transpose(1, 3).contiguous().transpose(1, 3), k, k)  # head dim not contiguous
