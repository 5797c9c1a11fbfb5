"""Two experts through one ring: the Wan2.2 layout on the toy DiT, on real gloo groups.

Two ToyDiTs of different depth (3 and 4 blocks: odd and even) stand in for ``transformer``
and ``transformer_2``, each saved to its own safetensors file and served as one module
through a prefix -> file checkpoint mapping. Checked: outputs are torch.equal to each
expert loaded resident; only the running expert's blocks are filled; the first block of
the next expert is the prefetch of the current one's last block when it is expected
(no dropped fill at the switch), and a wrong guess is refilled, not computed with; DP2
AllGather ticks where the ranks need different experts stay in step (one expert per tick,
the other rank replays it) and gather exactly that expert's bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from loadtest.ranks import run_ranks
from service.offload import Placement, enable_layerwise_offload, load_resident
from service.offload.mode import OffloadMode

from .toy import ToyDiT, empty_model, make_checkpoint

DEPTHS = (3, 4)
NAMES = ("transformer", "transformer_2")


class Pair(nn.Module):
    """What service.models.experts.Experts is: the experts as named children."""

    def __init__(self, a: nn.Module, b: nn.Module) -> None:
        super().__init__()
        self.transformer, self.transformer_2 = a, b


def _pair() -> Pair:
    return Pair(empty_model(depth=DEPTHS[0]), empty_model(depth=DEPTHS[1]))


def _offload(files: dict[str, str], group: dist.ProcessGroup | None = None, allgather: bool = True,
             placement: Placement | None = None) -> tuple[Pair, object]:
    model = _pair()
    h = enable_layerwise_offload(model, {f"{n}.": files[n] for n in NAMES}, device="cpu", group=group,
                                 mode=OffloadMode.ALLGATHER if allgather else OffloadMode.RANK_LOCAL,
                                 block_attrs=[f"{n}.blocks" for n in NAMES],
                                 experts=NAMES, placement=placement)
    return model, h


def _x(seed: int) -> torch.Tensor:
    return torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("experts")
    out = {}
    for seed, (name, depth) in enumerate(zip(NAMES, DEPTHS, strict=True)):
        out[name] = str(root / f"{name}.safetensors")
        make_checkpoint(out[name], depth=depth, seed=10 + seed)
    return out


@pytest.fixture(scope="module")
def resident(files: dict[str, str]) -> list[ToyDiT]:
    return [load_resident(empty_model(depth=d), files[n]) for n, d in zip(NAMES, DEPTHS, strict=True)]


def _prefixes(h: object) -> list[str]:
    """Log every fill's block prefix (the ring's on_fill callback)."""
    log: list[str] = []
    count = h.ring.on_fill  # type: ignore[attr-defined]

    def fill(layout: object) -> None:
        log.append(layout.prefix)  # type: ignore[attr-defined]
        count(layout)

    h.ring.on_fill = fill  # type: ignore[attr-defined]
    return log


PLAN = (0, 0, 1, 1, 1, 0)  # experts of six forwards: a switch each way


def test_one_rank_equal_resident_and_fills_only_the_active_expert(files: dict, resident: list) -> None:
    model, h = _offload(files)
    log = _prefixes(h)
    experts = (model.transformer, model.transformer_2)
    try:
        with torch.inference_mode():
            for k, e in enumerate(PLAN):
                h.expect(PLAN[k + 1] if k + 1 < len(PLAN) else 0)
                assert torch.equal(experts[e](_x(k)), resident[e](_x(k))), k
        st = h.stats()
    finally:
        h.close()
    # each forward fills its own expert's blocks, in order, and the last block's prefetch is
    # the first block of the expected next expert (no fill is ever dropped)
    want = [f"{NAMES[e]}.blocks.{i}." for e in PLAN for i in range(DEPTHS[e])] + ["transformer.blocks.0."]
    assert log == want
    assert st.prefetch_redirects == 0
    assert st.expert_forwards == [PLAN.count(0), PLAN.count(1)]
    assert st.forwards == len(PLAN) and st.experts == 2
    assert st.blocks == sum(DEPTHS)


def test_wrong_guess_is_refilled_not_used(files: dict, resident: list) -> None:
    """No expect(): the ring guesses the same expert again; each switch drops one fill."""
    model, h = _offload(files)
    experts = (model.transformer, model.transformer_2)
    try:
        with torch.inference_mode():
            for k, e in enumerate(PLAN):
                assert torch.equal(experts[e](_x(k)), resident[e](_x(k))), k
        st = h.stats()
    finally:
        h.close()
    assert st.prefetch_redirects == 2  # 0 -> 1 and 1 -> 0


def test_resident_layers_cover_both_experts(files: dict, resident: list) -> None:
    model, h = _offload(files, placement=Placement(resident_blocks=4))
    log = _prefixes(h)
    experts = (model.transformer, model.transformer_2)
    try:
        with torch.inference_mode():
            for k, e in enumerate(PLAN):
                h.expect(PLAN[k + 1] if k + 1 < len(PLAN) else 0)
                assert torch.equal(experts[e](_x(k)), resident[e](_x(k))), k
        st = h.stats()
    finally:
        h.close()
    assert st.resident_blocks == 4
    streamed = set(log)
    assert any(p.startswith("transformer.") for p in streamed)
    assert any(p.startswith("transformer_2.") for p in streamed)
    assert len(streamed) == sum(DEPTHS) - 4  # the spread leaves blocks of both experts streamed
    assert st.prefetch_redirects == 0


# Four ticks of a DP2 group: the expert each tick runs, and who computes in it.
TICKS = (0, 1, 1, 0)
RUNS = {0: (0, 1), 1: (1,), 2: (1,), 3: (0,)}  # tick -> ranks that compute (the others replay)


def _ticks_main(rank: int, world: int, files: dict) -> dict:
    out = {}
    for mode in ("allgather", "rank-local"):
        model, h = _offload(files, dist.group.WORLD, allgather=mode == "allgather")
        experts = (model.transformer, model.transformer_2)
        ys = []
        with torch.inference_mode():
            for t, e in enumerate(TICKS):
                h.expect(TICKS[t + 1] if t + 1 < len(TICKS) else 0)
                if rank in RUNS[t]:
                    ys.append((t, e, experts[e](_x(10 * rank + t))))
                else:
                    h.idle_forwards(1, expert=e)
        out[mode] = {"ys": ys, "stats": h.stats().as_dict(),
                     "padded": [lay.padded_bytes(world) for lay in h.layouts]}
        h.close()
    return out


def test_dp2_ticks_in_different_experts(files: dict, resident: list) -> None:
    results = run_ranks(_ticks_main, 2, files)
    for rank, res in enumerate(results):
        for mode in ("allgather", "rank-local"):
            ys = res[mode]["ys"]
            assert [t for t, _, _ in ys] == [t for t in range(len(TICKS)) if rank in RUNS[t]]
            for t, e, y in ys:
                assert torch.equal(y, resident[e](_x(10 * rank + t))), (rank, mode, t)
        st, padded = res["allgather"]["stats"], res["allgather"]["padded"]
        # every tick gathers one expert's blocks: the sum over ticks (+1 block: the prefetch
        # of the next tick's first block), the same on both ranks
        per_expert = [sum(padded[:DEPTHS[0]]), sum(padded[DEPTHS[0]:])]
        assert st["gathered_bytes"] == sum(per_expert[e] for e in TICKS) + padded[0]
        assert st["prefetch_redirects"] == 0
        assert st["forwards"] + st["idle_forwards"] == len(TICKS)
        assert res["rank-local"]["stats"]["gathered_bytes"] == 0
    gathered = {res["allgather"]["stats"]["gathered_bytes"] for res in results}
    assert len(gathered) == 1


def test_experts_must_own_every_block(files: dict) -> None:
    model = _pair()
    with pytest.raises(ValueError, match="belongs to none"):
        enable_layerwise_offload(model, {f"{n}.": files[n] for n in NAMES}, device="cpu",
                                 block_attrs=[f"{n}.blocks" for n in NAMES], experts=["transformer_2"])


def test_prefix_mapping_checkpoint_names_missing_keys(files: dict, tmp_path: Path) -> None:
    model = _pair()
    with pytest.raises(ValueError, match="missing keys"):
        enable_layerwise_offload(model, {"transformer.": files["transformer"]}, device="cpu",
                                 block_attrs=[f"{n}.blocks" for n in NAMES], experts=NAMES)
