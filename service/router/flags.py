"""The rank placement and scheduling flags ``serve`` and the batch job share (argparse only:
the CLIs build their parsers without importing torch or Ray)."""

from __future__ import annotations

import argparse


def _count(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {n}")
    return n


def add_engine_arguments(p: argparse.ArgumentParser, deadline_base_s: float) -> None:
    """Where the ranks run and how they are scheduled: shared by ``serve`` and the batch job."""
    g = p.add_argument_group("rank placement and scheduling")
    g.add_argument("--gpus-per-rank", type=float, default=None,
                   help="default: 1 if the cluster has GPUs, else 0")
    g.add_argument("--cpus-per-rank", type=float, default=None,
                   help="CPUs reserved per rank (its MP4 encoders follow them); default: serve on a "
                        "cluster of its own shares the node's CPUs, less 2 for the ingress, among its "
                        "ranks (at least 1); on a joined cluster and in the batch job, 1")
    g.add_argument("--placement-strategy", default="STRICT_PACK",
                   choices=["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"])
    g.add_argument("--scheduler", choices=("continuous", "waves"), default="continuous",
                   help="continuous: a freed rank starts the next request at the next forward; "
                        "waves: request-level waves of one compatibility key")
    g.add_argument("--encoders-per-rank", type=int, default=None,
                   help="MP4 encoder processes beside each rank (default: auto, the rank's CPUs "
                        "// x264 threads per encode, at least 1; 0: encode on the rank)")
    g.add_argument("--rank-standby", action=argparse.BooleanOptionalAction, default=None,
                   help="keep one pre-imported process per rank waiting, so a rank that dies is "
                        "replaced without a new interpreter and its imports (host memory: about one "
                        "process's imports per rank); default: on with GPU ranks, off on CPU")
    g.add_argument("--job-retries", type=_count, default=1,
                   help="the request on a rank whose process died runs again, ahead of the queue, up "
                        "to this many times (the group's other requests, which only stood by, "
                        "always do); 0: no request runs again, they fail with the reason")
    g.add_argument("--wave-deadline-base-s", type=float, default=deadline_base_s,
                   help="fixed part of each request's deadline")
    g.add_argument("--wave-deadline-per-forward-s", type=float, default=10.0,
                   help="deadline = base + this x forwards x (pixels*frames / 832*480*81)")
