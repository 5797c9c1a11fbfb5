"""Resident blocks filled on threads (offload.fill): every buffer is byte for byte what one
thread builds on the host (zeroed, each tensor copied in its place, a cast where the stored
dtype differs), in the blocks' order, whatever the number of threads."""

from __future__ import annotations

import pytest
import torch

from service.offload.fill import fill_blocks
from service.offload.layout import BlockLayout, plan_block

SHAPES = {"attn.weight": (24, 16), "attn.bias": (24,), "norm.weight": (5,), "ff.weight": (16, 33)}


def blocks(n: int) -> tuple[list[tuple[BlockLayout, dict[str, str]]], dict[str, torch.Tensor]]:
    """``n`` blocks' layouts (bf16, the norm kept fp32) and their float32 "checkpoint"."""
    g = torch.Generator().manual_seed(3)
    stored: dict[str, torch.Tensor] = {}
    out = []
    for i in range(n):
        tensors = [(name, torch.float32 if name.startswith("norm") else torch.bfloat16, shape)
                   for name, shape in SHAPES.items()]
        keys = {name: f"blocks.{i}.{name}" for name in SHAPES}
        for name, shape in SHAPES.items():
            stored[keys[name]] = torch.randn(shape, generator=g)
        out.append((plan_block(i, f"blocks.{i}", tensors), keys))
    return out, stored


def on_host(lay: BlockLayout, keys: dict[str, str], stored: dict[str, torch.Tensor]) -> torch.Tensor:
    """The buffer as it was built before: a zeroed host buffer, each tensor copied in."""
    buf = torch.zeros(lay.total_bytes, dtype=torch.uint8)
    for e in lay.entries:
        e.view(buf).copy_(stored[keys[e.name]])
    return buf


@pytest.mark.parametrize("workers", [1, 3, None])
def test_filled_buffers_equal_the_host_built_ones(workers: int | None) -> None:
    items, stored = blocks(7)
    got = fill_blocks(items, stored.__getitem__, torch.device("cpu"), workers=workers)
    assert len(got) == len(items)
    for (lay, keys), buf in zip(items, got, strict=True):
        assert buf.dtype == torch.uint8 and buf.numel() == lay.total_bytes
        assert torch.equal(buf, on_host(lay, keys, stored)), lay.prefix
    assert any(lay.total_bytes > sum(e.nbytes for e in lay.entries) for lay, _ in items)  # padding checked


def test_no_blocks_fill_nothing() -> None:
    assert fill_blocks([], {}.__getitem__, torch.device("cpu")) == []


def test_a_fill_behind_answers_each_block_when_it_is_in() -> None:
    """``ResidentFill`` copies behind its caller: ``wait(k)`` returns once block k is in,
    while a later one still waits for its bytes; ``wait()`` then has them all, equal."""
    import threading

    from service.offload.fill import ResidentFill

    items, stored = blocks(4)
    gate = threading.Event()

    def view(key: str) -> torch.Tensor:
        if key.startswith("blocks.3."):
            assert gate.wait(60)  # block 3's file is slow
        return stored[key]

    fill = ResidentFill(items, view, torch.device("cpu"), workers=2)
    fill.wait(0)
    assert torch.equal(fill.buffers[0], on_host(*items[0], stored))
    assert not torch.equal(fill.buffers[3], on_host(*items[3], stored))  # not in yet
    gate.set()
    fill.wait()
    for (lay, keys), buf in zip(items, fill.buffers, strict=True):
        assert torch.equal(buf, on_host(lay, keys, stored)), lay.prefix
