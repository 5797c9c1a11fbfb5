"""Forwards that stop early (step caches): no fill of a block that will not run, same outputs.

The toy stops at block ``stop`` (None: runs every block). Two ways to skip, as the models
do: calling the skipped blocks as pass-throughs (diffusers' cache hooks replace a block's
``forward``, so our pre-hooks still run) or not calling them at all (caught up when the
forward ends). Outputs are torch.equal to the resident toy with the same stops; the fills
that were not made are exactly the bytes the stats say were skipped; in a DP2 AllGather
group a block is gathered when any rank needs it and each rank still gets its own output.
With two experts sharing one ring (Wan2.2's layout) each expert's forward is one segment:
its decision points are its own first two blocks, a stop keeps the ring's fills matched on
every rank (the expected next expert included) and never fills a block that does not run.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from loadtest.ranks import run_ranks
from service.offload import enable_layerwise_offload, load_resident
from service.offload.mode import OffloadMode

from .toy import ToyBlock, ToyDiT, make_checkpoint

DEPTH = 5


class SkipBlock(ToyBlock):
    skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.skip else super().forward(x)


class SkipToy(ToyDiT):
    """ToyDiT whose forward stops at ``self.stop`` (the same checkpoint keys)."""

    def __init__(self, passthrough: bool, depth: int = DEPTH) -> None:
        super().__init__(depth=depth)
        self.blocks = torch.nn.ModuleList(SkipBlock(64, 160) for _ in range(depth))
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


def empty(passthrough: bool = True, depth: int = DEPTH) -> SkipToy:
    with torch.device("meta"):
        m = SkipToy(passthrough, depth)
    m.freqs = torch.arange(64, dtype=torch.float32)
    return m


def run(model: SkipToy, handle, xs: list[torch.Tensor],
        stops: list[int | None]) -> list[torch.Tensor]:  # noqa: ANN001
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
        h = enable_layerwise_offload(model, ckpt, device="cpu",
                                     mode=OffloadMode.ALLGATHER if use_allgather else OffloadMode.RANK_LOCAL)
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
                                     mode="rank-local" if mode == "rank-local" else "allgather")
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


# -- two experts (one ring, two segments) ----------------------------------------------

DEPTHS = (3, 4)
NAMES = ("transformer", "transformer_2")
# (expert, stop) of each forward: stops before and after each expert's first block, a switch
# right after a stopped forward (either way), and stops twice in a row in one expert
PLAN = [(0, None), (0, 1), (0, 1), (1, 0), (1, None), (1, 1), (0, 0), (0, None), (1, 1), (1, None), (0, None)]


class SkipPair(torch.nn.Module):
    def __init__(self, passthrough: bool) -> None:
        super().__init__()
        self.transformer = empty(passthrough, DEPTHS[0])
        self.transformer_2 = empty(passthrough, DEPTHS[1])


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("skippair")
    out = {}
    for seed, (name, depth) in enumerate(zip(NAMES, DEPTHS, strict=True)):
        out[name] = str(root / f"{name}.safetensors")
        make_checkpoint(out[name], depth=depth, seed=20 + seed)
    return out


def _pair_offload(files: dict[str, str], passthrough: bool, group: dist.ProcessGroup | None = None,
                  mode: OffloadMode | str = OffloadMode.ALLGATHER) -> tuple[SkipPair, object, list[str]]:
    model = SkipPair(passthrough)
    h = enable_layerwise_offload(model, {f"{n}.": files[n] for n in NAMES}, device="cpu", group=group,
                                 mode=mode, block_attrs=[f"{n}.blocks" for n in NAMES],
                                 experts=NAMES)
    h.enable_skips((0, 1))
    log: list[str] = []
    count = h.ring.on_fill

    def fill(layout: object) -> None:
        log.append(layout.prefix)  # type: ignore[attr-defined]
        count(layout)

    h.ring.on_fill = fill
    return model, h, log


def _pair_run(model: SkipPair, h, plan: list, xs: list[torch.Tensor]) -> list[torch.Tensor]:  # noqa: ANN001
    experts = (model.transformer, model.transformer_2)
    out = []
    for k, ((e, stop), x) in enumerate(zip(plan, xs, strict=True)):
        if h is not None:
            h.expect(plan[k + 1][0] if k + 1 < len(plan) else 0)
        if stop == "idle":
            h.idle_forwards(1, expert=e)
            continue
        out += run(experts[e], h, [x], [stop])
    return out


def _pair_reference(files: dict[str, str], plan: list, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    model = SkipPair(True)
    for name in NAMES:
        load_resident(getattr(model, name), files[name])
    return _pair_run(model, None, [p for p in plan if p[1] != "idle"],
                     [x for x, p in zip(xs, plan, strict=True) if p[1] != "idle"])


def _want_fills(plan: list) -> tuple[list[str], int]:
    """The fills one ring makes for ``plan`` with every expect right, and its redirects."""
    log, redirects = [], 0
    pending = reuse = None  # (expert, block)
    for k, (e, stop) in enumerate(plan):
        nxt = plan[k + 1][0] if k + 1 < len(plan) else 0
        if reuse != (e, 0):  # begin(): what a stopped forward kept is for its own expert only
            reuse = None
            if pending != (e, 0):
                redirects += pending is not None
                log.append(f"{NAMES[e]}.blocks.0.")
                pending = (e, 0)
        for i in range(DEPTHS[e] if stop is None else stop):
            if reuse == (e, i):  # still in its slot: no fill, the next block is pending
                reuse = None
                continue
            pending = (e, i + 1) if i + 1 < DEPTHS[e] else (nxt, 0)  # the fill after block i
            log.append(f"{NAMES[pending[0]]}.blocks.{pending[1]}.")
        if stop == 1:
            reuse = (e, 0)
    return log, redirects


@pytest.mark.parametrize("passthrough", [True, False])
@pytest.mark.parametrize("use_allgather", [True, False])
def test_two_experts_stop_each_expert_forward_at_its_own_first_blocks(pair_files: dict, use_allgather: bool,
                                                                      passthrough: bool) -> None:
    xs = inputs(len(PLAN), 3)
    want = _pair_reference(pair_files, PLAN, xs)
    model, h, log = _pair_offload(pair_files, passthrough,
                                  mode=OffloadMode.ALLGATHER if use_allgather else OffloadMode.RANK_LOCAL)
    try:
        with torch.inference_mode():
            got = _pair_run(model, h, PLAN, xs)
        st = h.stats()
    finally:
        h.close()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    want_log, redirects = _want_fills(PLAN)
    assert log == want_log  # no fill of a block past a stop; the next expert's first block prefetched
    assert st.prefetch_redirects == redirects  # only a stopped forward followed by the other expert
    stopped = [(e, s) for e, s in PLAN if s is not None]
    assert st.skips == len(stopped)
    assert st.blocks_skipped == sum(DEPTHS[e] - s for e, s in stopped)
    assert st.blocks_reused == sum(1 for k, (e, s) in enumerate(PLAN[:-1]) if s == 1 and PLAN[k + 1][0] == e)
    assert st.expert_forwards == [sum(e == 0 for e, _ in PLAN), sum(e == 1 for e, _ in PLAN)]
    assert st.forwards == len(PLAN)


# rank -> (expert, stop) per tick: the group runs one expert per tick (engine.experts); the
# ranks stop at different points, and an idle rank replays the tick's expert
PAIR_SCHEDULES = {
    0: [(0, 1), (0, 0), (1, 1), (1, None), (1, 0), (0, "idle"), (0, None)],
    1: [(0, None), (0, 0), (1, 1), (1, 1), (1, "idle"), (0, 1), (0, None)],
}


def _pair_dp2(rank: int, world: int, files: dict) -> dict:
    out = {}
    for mode, passthrough in (("allgather", True), ("allgather-uncalled", False), ("rank-local", True)):
        model, h, log = _pair_offload(files, passthrough, dist.group.WORLD,
                                      mode="rank-local" if mode == "rank-local" else "allgather")
        xs = inputs(len(PAIR_SCHEDULES[rank]), 30 + rank)
        with torch.inference_mode():
            ys = _pair_run(model, h, PAIR_SCHEDULES[rank], xs)
        out[mode] = {"ys": ys, "stats": h.stats().as_dict(), "log": log}
        h.close()
    return out


def test_two_experts_dp2_group_keeps_one_fill_sequence(pair_files: dict) -> None:
    results = run_ranks(_pair_dp2, 2, pair_files)
    for rank, res in enumerate(results):
        sched = PAIR_SCHEDULES[rank]
        want = _pair_reference(pair_files, sched, inputs(len(sched), 30 + rank))
        for mode in ("allgather", "allgather-uncalled", "rank-local"):
            got = res[mode]["ys"]
            assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), \
                (rank, mode)
    for mode in ("allgather", "allgather-uncalled"):
        logs = [res[mode]["log"] for res in results]
        assert logs[0] == logs[1]  # the same fills in the same order on both ranks
        ag = [res[mode]["stats"] for res in results]
        assert ag[0]["gathered_bytes"] == ag[1]["gathered_bytes"] > 0
        # stopped where neither rank needed more: tick 1 before block 0, tick 2 after it, tick
        # 4 before it and tick 5 after it (the idle rank votes no); the others went on
        assert ag[0]["skips"] == ag[1]["skips"] == 4
        assert ag[0]["blocks_skipped"] == ag[1]["blocks_skipped"] == \
            DEPTHS[0] + (DEPTHS[1] - 1) + DEPTHS[1] + (DEPTHS[0] - 1)
        assert ag[0]["skip_overruled"] == 2  # tick 0 after block 0, idle in tick 5 at block 0
        assert ag[1]["skip_overruled"] == 1  # tick 3 after block 0
        assert ag[0]["prefetch_redirects"] == ag[1]["prefetch_redirects"]
    rl = [res["rank-local"]["stats"] for res in results]
    assert rl[0]["skip_agree_s"] == 0.0
