"""The same runtime on CUDA: streams, events, pinned shards. Runs where a GPU is present."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service.offload import Placement, enable_layerwise_offload, load_resident

from .toy import empty_model, make_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(("use_allgather", "pagecache"), [(True, None), (False, False), (False, None)],
                         ids=["allgather", "ranklocal-pack", "ranklocal-pagecache"])
def test_cuda_equal_resident(tmp_path: Path, use_allgather: bool, pagecache: bool | None) -> None:
    ckpt = tmp_path / "m.safetensors"
    make_checkpoint(str(ckpt), dim=256, hidden=1024, depth=7)
    ref = load_resident(empty_model(256, 1024, 7), ckpt, device="cuda")
    model = empty_model(256, 1024, 7)
    handle = enable_layerwise_offload(model, ckpt, device="cuda", use_allgather=use_allgather,
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
