"""GEMMs fused with their neighbours while compiling (service.models.fused_gemms), on CPU.

The graph a compiled Wan block traces has two Linear calls fewer with the q, k, v fusion
(self-attention's q, k, v as one), the same output, and diffusers' three GEMMs wherever the fusion
would not be the same arithmetic (hooks: LoRA's side branches; FP8 weights off their FP8 GEMM;
eager forwards). The GELU epilogue is CUDA only (torch's CPU kernel computes erf, not tanh): here
its refusals, and that a CPU graph keeps diffusers' GELU; its numbers are checked on the GPU
(loadtest/gpu_check_attention.py ``exact_routes`` against ``exact_unfused``; the epilogue alone was
``exact_nogelu``, docs/benchmarks.md).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers.models import activations
from diffusers.models.transformers.transformer_wan import WanTransformerBlock
from torch import nn

from service.models import attention, fused_gemms
from service.models.fused_gemms import gelu_fusible, gelu_gemm, one_gemm
from service.offload.quant import Fp8Compute, Fp8Linear, quantize_weight, weight_scales

DIM, HEADS, TOKENS, TEXT = 64, 4, 24, 8


def _block() -> WanTransformerBlock:
    torch.manual_seed(0)
    return WanTransformerBlock(DIM, 128, HEADS, qk_norm="rms_norm_across_heads", cross_attn_norm=True,
                               eps=1e-6).eval()


def _inputs() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(1)
    cos = torch.randn(1, TOKENS, 1, DIM // HEADS)
    return (torch.randn(2, TOKENS, DIM), torch.randn(2, TEXT, DIM), torch.randn(2, 6, DIM),
            (cos, torch.randn_like(cos)))


def _compiled_linears(block: WanTransformerBlock, fused: bool) -> tuple[int, torch.Tensor]:
    """(Linear calls in the graph dynamo traced for the block's forward, its output)."""
    counts: list[int] = []

    def backend(gm: torch.fx.GraphModule, _inputs: object) -> object:
        counts.append(sum(n.op == "call_function" and n.target is F.linear for n in gm.graph.nodes))
        assert not any(n.target is torch._addmm_activation for n in gm.graph.nodes)  # CPU: no GELU epilogue
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(type(block).forward, backend=backend, fullgraph=True)
    with attention.chosen("exact", fused_gemms.FUSIONS if fused else frozenset()), torch.no_grad():
        out = fn(block, *_inputs())
    assert len(counts) == 1
    return counts[0], out


def test_a_compiled_block_runs_q_k_v_as_one_gemm_with_the_same_output() -> None:
    block = _block()
    fused, out = _compiled_linears(block, fused=True)
    three, ref = _compiled_linears(block, fused=False)
    # self-attention q, k, v, out; cross-attention q, k, v, out; the FFN's two: 10 unfused
    assert (three, fused) == (10, 8)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # eager forwards keep diffusers' three GEMMs: the same output again
        torch.testing.assert_close(block(*_inputs()), ref, rtol=1e-5, atol=1e-5)


def test_hooked_linears_are_not_fused() -> None:
    """LoRA's side branches are forward hooks on the Linears: one GEMM would skip them."""
    block = _block()
    block.attn1.to_k.register_forward_hook(lambda _m, _i, o: o * 2)
    fused, _ = _compiled_linears(block, fused=True)
    assert fused == 10


def test_one_gemm_is_the_three_linears_or_none() -> None:
    torch.manual_seed(2)
    x = torch.randn(5, DIM)
    layers = tuple(nn.Linear(DIM, DIM) for _ in range(3))
    got = one_gemm(x, layers)
    assert got is not None
    torch.testing.assert_close(got, torch.cat([m(x) for m in layers], dim=-1))
    no_bias = nn.Linear(DIM, DIM, bias=False)
    assert one_gemm(x, (layers[0], no_bias, layers[2])) is None  # a bias on some only
    assert one_gemm(x, (no_bias, nn.Linear(DIM, DIM, bias=False))) is not None


@pytest.mark.parametrize("compute", [Fp8Compute.UPCAST, Fp8Compute.SCALED_MM])
def test_fp8_weights_fuse_only_on_their_fp8_gemm(compute: Fp8Compute) -> None:
    """Off CUDA (and for non-bf16 inputs) Fp8Linear computes by upcasting: left to diffusers.
    Its FP8 GEMM (scales concatenate with the rows) is checked on the H200
    (loadtest/gpu_check_attention.py ``fp8_weights_attn_fp8`` against ``..._unfused``)."""
    layers = []
    for _ in range(3):
        lin = nn.Linear(DIM, DIM)
        fp8 = Fp8Linear.like(lin, compute)
        fp8.weight = nn.Parameter(quantize_weight(lin.weight.data), requires_grad=False)
        fp8.weight_scale = weight_scales(lin.weight.data)
        layers.append(fp8)
    assert one_gemm(torch.randn(5, DIM), tuple(layers)) is None  # float32 input: not the FP8 GEMM


def test_the_gelu_epilogue_is_taken_only_where_it_is_the_same_maths() -> None:
    torch.manual_seed(3)
    proj = nn.Linear(DIM, 2 * DIM).bfloat16()
    bf = torch.bfloat16
    assert gelu_fusible(proj, "tanh", "cuda", bf)
    assert gelu_fusible(nn.Linear(DIM, 2 * DIM).half(), "tanh", "cuda", torch.float16)
    assert not gelu_fusible(proj, "tanh", "cpu", bf)  # torch's CPU kernel computes erf
    assert not gelu_fusible(proj, "tanh", "cuda", torch.float32)  # half precision only
    assert not gelu_fusible(proj, "none", "cuda", bf)  # diffusers' erf GELU has no cuBLASLt epilogue
    assert not gelu_fusible(nn.Linear(DIM, 2 * DIM, bias=False).bfloat16(), "tanh", "cuda", bf)
    fp8 = Fp8Linear.like(nn.Linear(DIM, 2 * DIM), Fp8Compute.SCALED_MM)
    assert not gelu_fusible(fp8, "tanh", "cuda", bf)  # FP8 weights keep the GELU apart
    proj.register_forward_hook(lambda _m, _i, o: o)
    assert not gelu_fusible(proj, "tanh", "cuda", bf)  # LoRA's side branches are hooks
    assert gelu_gemm(torch.randn(5, DIM, dtype=bf), nn.Linear(DIM, 2 * DIM).bfloat16(), "tanh") is None  # CPU


def test_the_fusions_are_patched_for_the_duration_only() -> None:
    from diffusers.models.transformers import transformer_wan as wan

    gelu, qkv = activations.GELU.forward, wan._get_qkv_projections
    with fused_gemms.fused(frozenset({"gelu"})):
        assert activations.GELU.forward is not gelu and wan._get_qkv_projections is qkv
        patched = activations.GELU.forward
        with fused_gemms.fused():  # nested: the outer patch stays, nothing is wrapped twice
            assert activations.GELU.forward is patched
            assert wan._get_qkv_projections is not qkv
        assert wan._get_qkv_projections is qkv and activations.GELU.forward is patched
    assert activations.GELU.forward is gelu
    with pytest.raises(ValueError, match="unknown fusions"):
        with fused_gemms.fused(frozenset({"qkv", "rope"})):
            pass


def test_overlapping_users_keep_the_patch_until_the_last_leaves() -> None:
    """Two threads' forwards in one process: the first to leave must not unpatch the other's."""
    import threading

    gelu = activations.GELU.forward
    inside, leave = threading.Event(), threading.Event()
    seen: list[object] = []

    def other() -> None:
        with fused_gemms.fused(frozenset({"gelu"})):
            inside.set()
            leave.wait(10)
            seen.append(activations.GELU.forward)  # still patched while this one is inside

    t = threading.Thread(target=other)
    with fused_gemms.fused(frozenset({"gelu"})):
        patched = activations.GELU.forward
        t.start()
        assert inside.wait(10)
    assert activations.GELU.forward is patched is not gelu  # the first left; the other is inside
    leave.set()
    t.join(10)
    assert seen == [patched]
    assert activations.GELU.forward is gelu
