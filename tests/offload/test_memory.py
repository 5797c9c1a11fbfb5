"""Two ranks loading one >= 1 GB checkpoint cost about one copy of it, not two.

PSS (proportional set size) splits a shared page among the processes that map it, so
the sum over ranks counts the page cache once. Sampled from outside during loading
(the peak) and read by each rank after loading and after a forward.
"""

from __future__ import annotations

import threading
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from loadtest.ranks import run_ranks
from service.offload import enable_layerwise_offload

from .toy import empty_model

DIM, HIDDEN, DEPTH = 1024, 8192, 32  # 33.6 MB of bf16 per block, 1.07 GB in all


def pss_bytes(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no Pss line in smaps_rollup")


def _write_big_checkpoint(path: Path) -> int:
    """Every tensor a copy of one random pool's head: drawing 1 GB of random numbers took most
    of the test's time (20-45 s on this machine's CPU), copies take a second. Equal contents
    share nothing: PSS counts the page cache by file page, and the file has every byte."""
    model = empty_model(DIM, HIDDEN, DEPTH)
    g = torch.Generator().manual_seed(0)
    largest = max(v.numel() for v in model.state_dict().values())
    pool = {dt: torch.empty(largest, dtype=dt).uniform_(-0.02, 0.02, generator=g)
            for dt in (torch.float32, torch.bfloat16)}
    state = {}
    for k, v in model.state_dict().items():
        fp32 = ".norm." in k or "scale_shift" in k or "step_scale" in k
        dtype = torch.float32 if fp32 else torch.bfloat16
        state[k] = pool[dtype][: v.numel()].view(v.shape).clone()
    save_file(state, path)
    return sum(t.numel() * t.element_size() for t in state.values())


def _rank_main(rank: int, world: int, ckpt: str) -> dict:
    out: dict = {}
    x = torch.randn(1, 4, 16)
    for mode in ("allgather", "rank-local"):
        model = empty_model(DIM, HIDDEN, DEPTH)
        h = enable_layerwise_offload(model, ckpt, device="cpu", group=dist.group.WORLD,
                                     mode=mode)
        dist.barrier()
        loaded = pss_bytes()
        with torch.inference_mode():
            model(x)
        dist.barrier()
        out[mode] = {"loaded": loaded, "after_forward": pss_bytes(), "stats": h.stats().as_dict()}
        dist.barrier()
        h.close()
        del model, h
    return out


class PeakSampler(threading.Thread):
    """Sums the PSS of the rank processes every 20 ms; keeps the largest sum.

    Only processes started after the sampler that are ranks count: those forked from
    run_ranks' fork server (its children: the server itself, with its preloaded imports,
    is not a rank) or started by multiprocessing's spawn. A Ray cluster that an earlier test
    started also hangs off this process.
    """

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = 0
        self.ranks: set[int] = set()  # every rank seen: none seen would make the peak say nothing
        self.stop = threading.Event()
        self.before = {c.pid for c in psutil.Process().children(recursive=True)}

    def _is_rank(self, child: psutil.Process) -> bool:
        if child.pid in self.before:
            return False
        try:
            parent = child.parent()
            forked = parent is not None and "forkserver" in " ".join(parent.cmdline())
            return forked or "spawn_main" in " ".join(child.cmdline())
        except psutil.Error:
            return False

    def run(self) -> None:
        me = psutil.Process()
        while not self.stop.is_set():
            total = 0
            for child in me.children(recursive=True):
                if not self._is_rank(child):
                    continue
                self.ranks.add(child.pid)
                try:
                    total += pss_bytes(child.pid)
                except (OSError, RuntimeError):
                    pass
            self.peak = max(self.peak, total)
            self.stop.wait(0.02)


@pytest.mark.timeout(400)
def test_two_ranks_share_one_copy(tmp_path: Path) -> None:
    ckpt = tmp_path / "big.safetensors"
    nbytes = _write_big_checkpoint(ckpt)
    assert nbytes >= 2**30
    limit = 1.25 * nbytes + 2**30
    sampler = PeakSampler()
    sampler.start()
    try:
        results = run_ranks(_rank_main, 2, str(ckpt), timeout=360)
    finally:
        sampler.stop.set()
        sampler.join()
    report = {m: {k: sum(r[m][k] for r in results) / 2**30 for k in ("loaded", "after_forward")}
              for m in ("allgather", "rank-local")}
    print(f"checkpoint {nbytes / 2**30:.2f} GiB; peak PSS sum {sampler.peak / 2**30:.2f} GiB; {report}")
    assert len(sampler.ranks) == 2, sampler.ranks
    assert sampler.peak < limit, f"{report}: peak PSS {sampler.peak / 2**30:.2f} GiB over {limit / 2**30:.2f}"
    for mode in ("allgather", "rank-local"):
        for when in ("loaded", "after_forward"):
            total = sum(r[mode][when] for r in results)
            assert total < limit, f"{mode} {when}: PSS {total / 2**30:.2f} GiB over {limit / 2**30:.2f}"
    # AllGather: each rank holds exactly ceil(block/2) of every block, not a whole copy
    for r in results:
        st = r["allgather"]["stats"]
        assert nbytes / 2 * 0.99 < st["host_shard_bytes"] < nbytes / 2 * 1.01
        assert r["rank-local"]["stats"]["host_shard_bytes"] == 0
