"""FP8 weights through the offload path, on CPU with real gloo groups.

Resident FP8, layerwise DP1 (AllGather and rank-local), resident blocks and DLO AllGather /
rank-local DP2 give torch.equal outputs, quantized online or read from a checkpoint written
by ``write_quantized`` (which holds the bytes online quantization computes). The error
against the unquantized model is printed, and bounded only loosely.
"""

from __future__ import annotations

from itertools import product
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from loadtest.ranks import run_ranks
from service.offload import ALIGN, CheckpointError, Placement, enable_layerwise_offload, load_resident
from service.offload.auto import probe
from service.offload.checkpoint import Checkpoint
from service.offload.mode import OffloadMode
from service.offload.quant import (
    FP8,
    Fp8,
    Fp8Compute,
    Fp8Linear,
    dequantize,
    quantize_weight,
    weight_scales,
)
from service.offload.quant_checkpoint import write_quantized

from .toy import empty_model, make_checkpoint

COMPUTES = [Fp8Compute.UPCAST, Fp8Compute.SCALED_MM]  # torch's CPU _scaled_mm runs the second
FC_KEYS = [f"blocks.{i}.{fc}.weight" for i in range(5) for fc in ("fc1", "fc2")]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("fp8")
    bf16 = d / "model.safetensors"
    make_checkpoint(str(bf16))
    summary = write_quantized(bf16, d / "fp8", FC_KEYS)
    assert summary["quantized_weights"] == 10 and summary["bytes"] < summary["source_bytes"]
    return {"bf16": str(bf16), "fp8": str(d / "fp8" / "model.safetensors")}


def _inputs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(30 + rank)
    return [torch.randn(2, 9, 16, generator=g) for _ in range(3)]


def _run(model: torch.nn.Module, rank: int = 0) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model(x) for x in _inputs(rank)]


def _resident(ckpt: str, compute: Fp8Compute = Fp8Compute.UPCAST) -> torch.nn.Module:
    return load_resident(empty_model(), ckpt, quantization=Fp8(compute), block_attrs=["blocks"])


# -- the arithmetic -----------------------------------------------------------------------


def test_quantization_is_row_local_exact_and_bounded() -> None:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 64, generator=g) * torch.logspace(-6, 2, 96).unsqueeze(1)).to(torch.bfloat16)
    w[5] = 0  # an all-zero channel
    q, s = quantize_weight(w), weight_scales(w)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (96,)
    # powers of two, the smallest that fit: max|w_r| / s_r in (224, 448]
    assert torch.equal(torch.frexp(s)[0], torch.full_like(s, 0.5))
    ratio = w.float().abs().amax(1) / s
    assert bool(((ratio > 224) & (ratio <= 448)).logical_or(ratio == 0).all()) and s[5] == 1
    # row ranges (a rank's shard) quantize to the bytes of the whole tensor
    for lo, hi in ((0, 1), (7, 50), (95, 96)):
        assert torch.equal(quantize_weight(w[lo:hi]).view(torch.uint8), q[lo:hi].view(torch.uint8))
        assert torch.equal(weight_scales(w[lo:hi]), s[lo:hi])
    # dequantization is exact in bf16 and fp32 (power-of-two products), so equal to fp64's
    exact = q.double() * s.double().unsqueeze(1)
    assert torch.equal(dequantize(q, s, torch.float32).double(), exact)
    assert torch.equal(dequantize(q, s, torch.bfloat16).double(), exact)
    # e4m3: 3 mantissa bits, so a normal value is off by at most 2^-4 of itself
    err = (exact - w.double()).abs()
    normal = (w.double().abs() / s.double().unsqueeze(1)) >= 2**-6
    assert bool((err[normal] <= w.double().abs()[normal] * 2**-4).all())
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_weight(torch.tensor([[1.0, float("inf")]]))


# -- layout and bytes ---------------------------------------------------------------------


def test_fp8_is_its_own_aligned_dtype_region_and_halves_the_block(ckpts: dict) -> None:
    model = empty_model()
    h = enable_layerwise_offload(model, ckpts["bf16"], device="cpu", quantization="fp8")
    plain = enable_layerwise_offload(empty_model(), ckpts["bf16"], device="cpu")
    lay = h.layouts[0]
    assert all(e.offset % ALIGN == 0 for e in lay.entries)
    dtypes = {e.name: e.dtype for e in lay.entries}
    assert dtypes["fc1.weight"] == dtypes["fc2.weight"] == FP8
    assert dtypes["fc1.weight_scale"] == torch.float32  # scales stay fp32
    assert dtypes["fc1.bias"] == torch.bfloat16 and dtypes["norm.weight"] == torch.float32
    assert dtypes["scale_shift_table"] == torch.float32
    fp8 = [e for e in lay.entries if e.dtype == FP8]
    assert [e.offset for e in fp8] == sorted(e.offset for e in fp8) and fp8[0].offset >= max(
        e.offset + e.nbytes for e in lay.entries if e.dtype != FP8)  # one region, after the others
    assert lay.dtype_bytes[FP8] == sum(-(-e.nbytes // ALIGN) * ALIGN for e in fp8)
    # outside the blocks nothing is quantized
    assert type(model.embed) is torch.nn.Linear and model.embed.weight.dtype == torch.bfloat16
    assert isinstance(model.blocks[0].fc1, Fp8Linear)
    st, base = h.stats(), plain.stats()
    assert st.quantization == "fp8" and st.quantization_source == "online" and st.fp8_compute == "upcast"
    assert set(st.block_bytes_by_dtype) == {"torch.float8_e4m3fn", "torch.float32", "torch.bfloat16"}
    assert 0.5 < st.largest_block_bytes / base.largest_block_bytes < 0.6
    assert 0.5 < st.host_shard_bytes / base.host_shard_bytes < 0.6
    assert st.device_slot_bytes / base.device_slot_bytes == st.largest_block_bytes / base.largest_block_bytes
    h.close()
    plain.close()


def test_prequantized_checkpoint_holds_the_online_bytes(ckpts: dict) -> None:
    stored = load_file(ckpts["fp8"])
    source = load_file(ckpts["bf16"])
    assert set(stored) == set(source) | {k + "_scale" for k in FC_KEYS}
    for k in FC_KEYS:
        assert stored[k].dtype == FP8
        assert torch.equal(stored[k].view(torch.uint8), quantize_weight(source[k]).view(torch.uint8))
        assert torch.equal(stored[k + "_scale"], weight_scales(source[k]))
    for k in set(source) - set(FC_KEYS):  # everything else as stored
        assert torch.equal(stored[k], source[k]) and stored[k].dtype == source[k].dtype
    # the host copies are the same bytes: shards (AllGather) and resident blocks
    online = enable_layerwise_offload(empty_model(), ckpts["bf16"], device="cpu", quantization="fp8",
                                      placement=Placement(resident_blocks=2))
    pre = enable_layerwise_offload(empty_model(), ckpts["fp8"], device="cpu", quantization="fp8",
                                   placement=Placement(resident_blocks=2))
    assert pre.stats().quantization_source == "prequantized"
    assert [lay.entries for lay in online.layouts] == [lay.entries for lay in pre.layouts]
    for a, b in zip(online.host.blocks, pre.host.blocks, strict=True):
        assert torch.equal(a.shard, b.shard)
    for a, b in zip(online._resident_buffers, pre._resident_buffers, strict=True):
        assert torch.equal(a, b)
    # rank-local DMA reads stored bytes: possible from the fp8 files, not from online fp8
    rl_online = enable_layerwise_offload(empty_model(), ckpts["bf16"], device="cpu",
                                         mode=OffloadMode.RANK_LOCAL,
                                         quantization="fp8")
    rl_pre = enable_layerwise_offload(empty_model(), ckpts["fp8"], device="cpu", mode=OffloadMode.RANK_LOCAL,
                                      quantization="fp8")
    assert "computed at load" in rl_online.host.dma_problem() and "dloserve quantize" in \
        rl_online.host.dma_problem()
    assert rl_pre.host.dma_problem() is None
    for h in (online, pre, rl_online, rl_pre):
        h.close()


# -- bitwise equality across strategies --------------------------------------------------------


@pytest.mark.parametrize("compute", COMPUTES, ids=lambda c: c.value)
def test_dp1_strategies_equal_resident_fp8(ckpts: dict, compute: Fp8Compute) -> None:
    want = _run(_resident(ckpts["bf16"], compute))
    assert torch.equal(torch.stack(_run(_resident(ckpts["fp8"], compute))), torch.stack(want))
    for source in ("bf16", "fp8"):
        for use_allgather in (True, False):
            for k in (0, 2):
                model = empty_model()
                mode = OffloadMode.ALLGATHER if use_allgather else OffloadMode.RANK_LOCAL
                h = enable_layerwise_offload(model, ckpts[source], device="cpu", mode=mode,
                                             quantization=Fp8(compute),
                                             placement=Placement(resident_blocks=k))
                got = _run(model)
                assert h.stats().fp8_compute == compute.value
                h.close()
                for g, w in zip(got, want, strict=True):
                    assert torch.equal(g, w), (source, use_allgather, k, compute)


def _ranks_main(rank: int, world: int, ckpts: dict) -> dict:
    out = {}
    for compute, source, mode in product(COMPUTES, ("bf16", "fp8"), ("allgather", "rank-local")):
        model = empty_model()
        h = enable_layerwise_offload(model, ckpts[source], device="cpu", group=dist.group.WORLD,
                                     mode=mode, quantization=Fp8(compute))
        if rank == world - 1:  # the last rank only idles: it still joins every gather
            h.idle_forwards(len(_inputs(rank)))
            ys = []
        else:
            ys = _run(model, rank)
        out[(compute, source, mode)] = {"ys": ys, "stats": h.stats().as_dict()}
        h.close()
    return out


def test_dp2_gloo_equal_resident_fp8(ckpts: dict) -> None:
    """Two ranks: rank 0 runs, rank 1 idle-replays; both computes, online and prequantized,
    AllGather and rank-local."""
    results = run_ranks(_ranks_main, 2, ckpts)
    want = {c: _run(_resident(ckpts["bf16"], c), 0) for c in COMPUTES}
    plain = enable_layerwise_offload(empty_model(), ckpts["bf16"], device="cpu")
    bf16_block = plain.layouts[0].total_bytes
    plain.close()
    assert len(results[0]) == 8
    for (compute, source, mode), r in results[0].items():
        for g, w in zip(r["ys"], want[compute], strict=True):
            assert torch.equal(g, w), (compute, source, mode)
        st = r["stats"]
        assert st["quantization_source"] == ("online" if source == "bf16" else "prequantized")
        if mode == "allgather":  # each rank holds half of the fp8 block, the gathers move fp8
            assert st["host_shard_bytes"] == 5 * -(-st["largest_block_bytes"] // 2)
            assert st["largest_block_bytes"] < 0.6 * bf16_block
            other = results[1][(compute, source, mode)]["stats"]
            assert st["gathered_bytes"] == other["gathered_bytes"] > 0
    assert all(r["stats"]["idle_forwards"] == 3 for r in results[1].values())


# -- what counts fp8 bytes: the budget and the probe ---------------------------------------


def test_budget_and_probe_count_fp8_bytes(ckpts: dict) -> None:
    plain = enable_layerwise_offload(empty_model(), ckpts["bf16"], device="cpu")
    base, block = plain.stats().device_resident_bytes, plain.layouts[0].total_bytes
    plain.close()
    budget = base + 2 * block + 2 * block  # bf16: two slots and two resident blocks
    kept = {}
    for q in (None, "fp8"):
        model = empty_model()
        h = enable_layerwise_offload(model, ckpts["bf16"], device="cpu", quantization=q,
                                     placement=Placement(device_memory_budget=budget))
        st = h.stats()
        kept[q] = st.resident_blocks
        assert st.device_slot_bytes + st.device_resident_bytes <= budget
        if q == "fp8":  # non-block tensors are not quantized: the same bytes as bf16
            assert st.device_resident_bytes - st.device_resident_block_bytes == base
            with torch.inference_mode():
                t = probe(h, lambda m=model: m(_inputs(0)[0]))
            assert t.block_bytes == st.largest_block_bytes < 0.6 * block
        h.close()
    assert kept[None] == 2 and kept["fp8"] == 5  # fp8 blocks are half: all five fit


# -- what is refused ----------------------------------------------------------------------


def test_an_fp8_checkpoint_is_read_as_fp8_unless_told_none(ckpts: dict) -> None:
    """The folder says what it holds: quantization None takes its fp8 (the same host bytes
    and outputs as asking for fp8); "none" refuses it, naming the flag to drop."""
    own = enable_layerwise_offload(empty_model(), ckpts["fp8"], device="cpu",
                                   placement=Placement(resident_blocks=2))
    asked = enable_layerwise_offload(empty_model(), ckpts["fp8"], device="cpu", quantization="fp8",
                                     placement=Placement(resident_blocks=2))
    assert own.stats().quantization == "fp8" and own.stats().quantization_source == "prequantized"
    for a, b in zip(own.host.blocks, asked.host.blocks, strict=True):
        assert torch.equal(a.shard, b.shard)
    for h in (own, asked):
        h.close()
    assert torch.equal(torch.stack(_run(load_resident(empty_model(), ckpts["fp8"]))),
                       torch.stack(_run(load_resident(empty_model(), ckpts["fp8"], quantization="fp8"))))
    plain = enable_layerwise_offload(empty_model(), ckpts["bf16"], device="cpu")  # a bf16 one stays bf16
    assert not plain.stats().quantization
    plain.close()


def test_refusals_name_the_fix(ckpts: dict, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="drop --quantization none"):
        enable_layerwise_offload(empty_model(), ckpts["fp8"], device="cpu", quantization="none")
    with pytest.raises(CheckpointError, match="drop --quantization none"):
        load_resident(empty_model(), ckpts["fp8"], quantization="none")
    mixed = load_file(ckpts["fp8"])
    mixed["blocks.0.fc1.weight"] = load_file(ckpts["bf16"])["blocks.0.fc1.weight"]
    del mixed["blocks.0.fc1.weight_scale"]
    save_file(mixed, tmp_path / "mixed.safetensors")
    with pytest.raises(CheckpointError, match="quantize all of them or none"):
        enable_layerwise_offload(empty_model(), tmp_path / "mixed.safetensors", device="cpu",
                                 quantization="fp8")
    with pytest.raises(ValueError, match="quantization must be None, 'none' or 'fp8'"):
        enable_layerwise_offload(empty_model(), ckpts["bf16"], device="cpu", quantization="int4")
    ck = Checkpoint(ckpts["bf16"])
    ck.derive("blocks.0.fc1.weight", FP8, (160, 64), "blocks.0.fc1.weight", quantize_weight)
    with pytest.raises(ValueError, match="derived at load"):
        ck.raw("blocks.0.fc1.weight")


def test_error_against_the_unquantized_model_is_reported(ckpts: dict) -> None:
    ref = _run(load_resident(empty_model(), ckpts["bf16"]))
    for compute in COMPUTES:
        got = _run(_resident(ckpts["bf16"], compute))
        rel = max(float((g.float() - w.float()).norm() / w.float().norm())
                  for g, w in zip(got, ref, strict=True))
        print(f"toy model, fp8 {compute.value}: relative error {rel:.2e} against bf16")
        assert 0 < rel < 0.05
