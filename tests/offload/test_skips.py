"""Forwards that stop early (step caches): no fill of a block that will not run, same outputs.

The toy stops at block ``stop`` (None: runs every block). Two ways to skip, as the models
do: calling the skipped blocks as pass-throughs (diffusers' cache hooks replace a block's
``forward``, so our pre-hooks still run) or not calling them at all (caught up when the
forward ends). Outputs are torch.equal to the resident toy with the same stops; the fills
that were not made are exactly the bytes the stats say were skipped; in a DP2 AllGather
group a block is gathered when any rank needs it and each rank still gets its own output.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from service.offload import enable_layerwise_offload, load_resident
from service.offload.spawn import run_ranks

from .toy import ToyBlock, ToyDiT, make_checkpoint

DEPTH = 5


class SkipBlock(ToyBlock):
    skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.skip else super().forward(x)


class SkipToy(ToyDiT):
    """ToyDiT whose forward stops at ``self.stop`` (the same checkpoint keys)."""

    def __init__(self, passthrough: bool) -> None:
        super().__init__(depth=DEPTH)
        self.blocks = torch.nn.ModuleList(SkipBlock(64, 160) for _ in range(DEPTH))
        self.passthrough = passthrough
        self.stop: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.to(self.embed.weight.dtype)) + self.freqs.to(self.embed.weight.dtype)
        for i, blk in enumerate(self.blocks):
            skip = self.stop is not None and i >= self.stop
            if skip and not self.passthrough:
                continue
            blk.skip = skip
            h = blk(h)
        return self.head(h)


def empty(passthrough: bool = True) -> SkipToy:
    with torch.device("meta"):
        m = SkipToy(passthrough)
    m.freqs = torch.arange(64, dtype=torch.float32)
    return m


def run(model: SkipToy, handle, xs: list[torch.Tensor], stops: list[int | None]) -> list[torch.Tensor]:  # noqa: ANN001
    out = []
    for x, stop in zip(xs, stops, strict=True):
        model.stop = stop
        if handle is not None:
            handle.set_vote(lambda i, s=stop: s is None or i < s)
        with torch.inference_mode():
            out.append(model(x))
    return out


def inputs(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 9, 16, generator=g) for _ in range(n)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("skiptoy") / "model.safetensors"
    make_checkpoint(str(path), depth=DEPTH)
    return str(path)


def reference(ckpt: str, xs: list[torch.Tensor], stops: list[int | None]) -> list[torch.Tensor]:
    return run(load_resident(empty(), ckpt), None, xs, stops)


STOPS = [None, 1, 1, 0, None, 1, 0, None]  # stops after block 0, before it, twice in a row


@pytest.mark.parametrize("passthrough", [True, False])
@pytest.mark.parametrize("use_allgather", [True, False])
def test_single_rank_skips_fill_nothing_it_does_not_run(ckpt: str, use_allgather: bool,
                                                      passthrough: bool) -> None:
    xs = inputs(len(STOPS) + 1, 1)
    stops = STOPS + [None]  # a trailing full forward: both handles end at the same ring position
    want = reference(ckpt, xs, stops)
    stats = {}
    for name, schedule in (("plain", [None] * len(stops)), ("cached", stops)):
        model = empty(passthrough)
        h = enable_layerwise_offload(model, ckpt, device="cpu", use_allgather=use_allgather)
        h.enable_skips((0, 1))
        got = run(model, h, xs, schedule)
        stats[name] = h.stats()
        h.close()
        if name == "cached":
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    plain, cached = stats["plain"], stats["cached"]
    block = plain.fill_bytes // plain.fills
    assert cached.forwards == plain.forwards == len(stops)
    assert cached.skips == sum(s is not None for s in stops) and plain.skips == 0
    assert cached.blocks_skipped == sum(DEPTH - s for s in stops if s is not None)
    assert cached.blocks_reused == stops.count(1)  # block 0 stayed in its slot
    # every fill not made is counted, and nothing else was saved
    assert plain.fill_bytes - cached.fill_bytes == cached.fill_bytes_skipped
    assert cached.fill_bytes_skipped == block * (cached.blocks_skipped + cached.blocks_reused)
    assert cached.skip_decisions == 2 * len(stops) - stops.count(0)  # a stop at 0 ends the forward


def test_decisions_only_at_the_first_two_streamed_blocks(ckpt: str) -> None:
    model = empty()
    h = enable_layerwise_offload(model, ckpt, device="cpu")
    with pytest.raises(ValueError, match="first or second streamed block; block 2"):
        h.enable_skips((2,))
    h.close()


SCHEDULES = {  # rank -> stops (None: an idle rank, it only replays)
    0: [1, 1, 0, None, 0, 1],
    1: [None, 1, 0, 1, "idle", "idle"],
}


def _dp2(rank: int, world: int, ckpt: str) -> dict:
    out = {}
    for mode, passthrough in (("allgather", True), ("allgather-uncalled", False), ("rank-local", True)):
        model = empty(passthrough)
        h = enable_layerwise_offload(model, ckpt, device="cpu", group=dist.group.WORLD,
                                     use_allgather=mode != "rank-local")
        h.enable_skips((0, 1))
        ys = []
        xs = inputs(len(SCHEDULES[rank]), 10 + rank)
        for x, stop in zip(xs, SCHEDULES[rank], strict=True):
            if stop == "idle":
                h.idle_forwards(1)
            else:
                ys += run(model, h, [x], [stop])
        out[mode] = {"ys": ys, "stats": h.stats().as_dict()}
        h.close()
    return out


def test_dp2_group_gathers_a_block_when_any_rank_needs_it(ckpt: str) -> None:
    """Skipped blocks called as pass-throughs (allgather) or not called (allgather-uncalled)."""
    results = run_ranks(_dp2, 2, ckpt)
    for rank, res in enumerate(results):
        sched = SCHEDULES[rank]
        xs = inputs(len(sched), 10 + rank)
        real = [(x, s) for x, s in zip(xs, sched, strict=True) if s != "idle"]
        want = reference(ckpt, [x for x, _ in real], [s for _, s in real])
        for mode in ("allgather", "allgather-uncalled", "rank-local"):
            got = res[mode]["ys"]
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (rank, mode)
    counts = ("forwards", "idle_forwards", "gathered_bytes", "fills", "skips", "skip_decisions",
              "skip_overruled", "blocks_skipped", "blocks_reused", "fill_bytes_skipped")
    for res in results:  # calling skipped blocks or not: the same fills and decisions
        assert {k: res["allgather"]["stats"][k] for k in counts} == \
            {k: res["allgather-uncalled"]["stats"][k] for k in counts}
    ag = [res["allgather"]["stats"] for res in results]
    # the same gathers on both ranks; skipped only where neither needed more: forwards 1 and 5
    # after block 0 (in 5 rank 1 is idle: it votes no), 2 and 4 before it
    assert ag[0]["gathered_bytes"] == ag[1]["gathered_bytes"] > 0
    assert ag[0]["skips"] == ag[1]["skips"] == 4
    assert ag[0]["skip_overruled"] == 1  # forward 0 after block 0: rank 1 needed the rest
    assert ag[1]["skip_overruled"] == 2  # forward 3 after block 0, and idle in forward 5 at block 0
    assert ag[0]["blocks_skipped"] == ag[1]["blocks_skipped"] == (DEPTH - 1) * 2 + DEPTH * 2
    rl = [res["rank-local"]["stats"] for res in results]
    assert rl[0]["skips"] == 5 and rl[0]["skip_overruled"] == 0  # alone, each rank skips its own
    assert rl[0]["skip_agree_s"] == 0.0 and ag[0]["skip_agree_s"] > 0.0
