"""The group's rendezvous store listens on the address it was given, nowhere else."""

from __future__ import annotations

import multiprocessing as mp
import os
from datetime import timedelta
from typing import Any

from loadtest.ranks import PRELOAD
from service.engine.ports import free_port


def _member(rank: int, init: str, port: int, out: Any) -> None:
    """One process of a two-process gloo group formed through ``rendezvous_store``."""
    import torch
    import torch.distributed as dist

    from service.api.hostproc import listeners
    from service.engine.start import rendezvous_store

    store = rendezvous_store(init, rank, 2, timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    t = torch.ones(1)
    dist.all_reduce(t)
    # While the store serves the group: where does its port listen, and gloo's?
    out.put((rank, float(t), listeners([os.getpid()])))
    dist.barrier()
    dist.destroy_process_group()


def test_the_rendezvous_store_of_a_loopback_group_listens_on_loopback_only() -> None:
    port = free_port("127.0.0.1")
    init = f"tcp://127.0.0.1:{port}"
    # Forked from the fork server run_ranks uses (torch imported once there), not spawned: a
    # spawned member spent seconds of the test importing torch again. How the member process
    # started is no part of what the store listens on.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # no effect where the server already runs (as run_ranks sets it)
    out = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, init, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    seen = dict((rank, (total, socks)) for rank, total, socks in (out.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert [seen[r][0] for r in (0, 1)] == [2.0, 2.0]  # the group formed through the store and reduced
    assert [s for s in seen[0][1] if s["port"] == port], "the store's port is not listening"
    everything = seen[0][1] + seen[1][1]  # the store's and gloo's listeners, of both ranks
    assert all(s["address"] == "127.0.0.1" for s in everything), everything
