"""The same runtime on CUDA: streams, events, pinned shards. Runs where a GPU is present."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service.offload import Placement, enable_layerwise_offload, load_resident
from service.offload.mode import OffloadMode

from .toy import empty_model, make_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(("use_allgather", "pagecache"), [(True, None), (False, False), (False, None)],
                         ids=["allgather", "ranklocal-pack", "ranklocal-pagecache"])
def test_cuda_equal_resident(tmp_path: Path, use_allgather: bool, pagecache: bool | None) -> None:
    ckpt = tmp_path / "m.safetensors"
    make_checkpoint(str(ckpt), dim=256, hidden=1024, depth=7)
    ref = load_resident(empty_model(256, 1024, 7), ckpt, device="cuda")
    model = empty_model(256, 1024, 7)
    handle = enable_layerwise_offload(model, ckpt, device="cuda",
                                      mode=OffloadMode.ALLGATHER if use_allgather else OffloadMode.RANK_LOCAL,
                                      placement=Placement(pagecache=pagecache))
    xs = [torch.randn(2, 333, 16, device="cuda") for _ in range(4)]
    with torch.inference_mode():
        want = [ref(x) for x in xs]
        got = [model(x) for x in xs]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    st = handle.stats()
    total = sum(lay.total_bytes for lay in handle.layouts)
    assert st.forwards == 4
    # 4 forwards + the ring's prefetch of block 0 for a fifth
    assert st.h2d_bytes == 4 * total + handle.layouts[0].total_bytes
    assert st.device_slot_bytes == 2 * max(lay.total_bytes for lay in handle.layouts)
    if use_allgather:
        assert st.host_pinned_bytes == st.host_shard_bytes == total
    elif st.rank_local_source == "pagecache":  # DMA from the registered file: nothing pinned
        assert st.host_pinned_bytes == 0 and st.host_registered_bytes >= total
    else:  # pack: two staging buffers (also where the driver refused the page cache: it says why)
        assert st.host_pinned_bytes == st.device_slot_bytes
        assert st.source_reason
    assert st.stall_s >= 0.0
    handle.close()
    assert torch.cuda.memory_allocated() < 2 * total + 50 * 2**20


@pytest.mark.parametrize("compute", ["upcast", "scaled_mm"])
@pytest.mark.parametrize(("source", "use_allgather"), [("online", True), ("online", False),
                                                       ("prequantized", True), ("prequantized", False)],
                         ids=["online-allgather", "online-ranklocal", "pre-allgather", "pre-ranklocal"])
def test_cuda_fp8_equal_resident(tmp_path: Path, compute: str, source: str, use_allgather: bool) -> None:
    """FP8 on CUDA: every source and mode gives the resident FP8 bytes, for both computes."""
    from service.offload.quant import Fp8, Fp8Compute
    from service.offload.quant_checkpoint import write_quantized

    ckpt = tmp_path / "m.safetensors"
    make_checkpoint(str(ckpt), dim=256, hidden=1024, depth=7)
    weights = [f"blocks.{i}.{fc}.weight" for i in range(7) for fc in ("fc1", "fc2")]
    write_quantized(ckpt, tmp_path / "fp8", weights)
    path = ckpt if source == "online" else tmp_path / "fp8" / "m.safetensors"
    q = Fp8(Fp8Compute(compute))
    ref = load_resident(empty_model(256, 1024, 7), ckpt, device="cuda", quantization=q,
                        block_attrs=["blocks"])
    model = empty_model(256, 1024, 7)
    handle = enable_layerwise_offload(model, path, device="cuda",
                                      mode=OffloadMode.ALLGATHER if use_allgather else OffloadMode.RANK_LOCAL,
                                      quantization=q)
    xs = [torch.randn(2, 333, 16, device="cuda") for _ in range(3)]
    with torch.inference_mode():
        want = [ref(x) for x in xs]
        got = [model(x) for x in xs]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    st = handle.stats()
    assert st.fp8_compute == compute and st.quantization_source == source
    if source == "prequantized" and not use_allgather:  # the fp8 bytes DMA'd from the page cache
        assert st.rank_local_source == "pagecache", st.source_reason
    if source == "online" and not use_allgather:
        assert st.rank_local_source == "pack" and "computed at load" in st.source_reason
    handle.close()
