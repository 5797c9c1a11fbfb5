"""The flags of ``dloserve serve`` and what they become: a ServiceConfig (the Serve app's
``args``), the results URL and the API-key hashes. Parsing only; ``launch`` runs it."""

from __future__ import annotations

import argparse
import json
import os
import uuid
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="diffusers pipeline dir (default: demo)")
    p.add_argument("--data-parallel-size", type=int, default=1, help="DP ranks per group (N)")
    p.add_argument("--sequence-parallel-size", "--usp", type=int, default=1, dest="sequence_parallel_size",
                   help="ranks per request (S, Ulysses); with --data-parallel-size D: D groups of S")
    p.add_argument("--enable-distributed-layerwise-offload", action="store_true",
                   help="stream transformer blocks from host memory (DLO)")
    p.add_argument("--dlo-no-use-allgather", action="store_true",
                   help="rank-local DLO: every rank keeps whole blocks, no AllGather")
    from service.models.options import add_offload_arguments

    add_offload_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                   help="Ray cluster to join (default: start a local one)")
    p.add_argument("--num-replicas", type=int, default=1, help="DP groups (one per replica)")
    p.add_argument("--gpus-per-rank", type=float, default=None,
                   help="default: 1 if the cluster has GPUs, else 0")
    p.add_argument("--cpus-per-rank", type=float, default=1.0)
    p.add_argument("--placement-strategy", default="STRICT_PACK",
                   choices=["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"])
    p.add_argument("--max-wait-ms", type=float, default=50.0,
                   help="how long a partial wave waits for more compatible requests")
    p.add_argument("--queue-size", type=int, default=64, help="queued requests before 429")
    p.add_argument("--scheduler", choices=("continuous", "waves"), default="continuous",
                   help="continuous: a freed rank starts the next request at the next forward; "
                        "waves: request-level waves of one compatibility key")
    p.add_argument("--starve-s", type=float, default=30.0,
                   help="continuous: a request queued this long goes next, whatever its cost")
    p.add_argument("--encoders-per-rank", type=int, default=None,
                   help="MP4 encoder processes beside each rank (default: auto, the rank's CPUs "
                        "// x264 threads per encode, at least 1; 0: encode on the rank)")
    p.add_argument("--max-width", type=int, default=1280)
    p.add_argument("--max-height", type=int, default=1280)
    p.add_argument("--max-pixels", type=int, default=1280 * 720)
    p.add_argument("--max-frames", type=int, default=129)
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--wave-deadline-base-s", type=float, default=60.0,
                   help="fixed part of each request's deadline")
    p.add_argument("--wave-deadline-per-forward-s", type=float, default=10.0,
                   help="deadline = base + this x forwards x (pixels*frames / 832*480*81)")
    p.add_argument("--results-url", "--results-dir", dest="results_url", default=None,
                   help="folder or fsspec URL (s3://bucket/prefix) for job records and MP4s, seen "
                        "by every replica (default ~/.cache/dloserve/results/port-PORT; locked)")
    p.add_argument("--storage-options", type=json.loads, default={}, metavar="JSON",
                   help='fsspec options for --results-url, e.g. \'{"endpoint_url": "http://minio:9000"}\' '
                        "(credentials: the usual environment, e.g. AWS_ACCESS_KEY_ID)")
    p.add_argument("--group-timeout-s", type=float, default=30.0,
                   help="a replica (DP group) silent this long is lost: its jobs fail with a reason")
    p.add_argument("--retention-s", type=float, default=86400.0, help="keep finished jobs this long")
    p.add_argument("--max-jobs", type=int, default=1000, help="keep at most this many jobs")
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' (repeatable); jobs belong to their key")
    p.add_argument("--api-key-file", default=None, help="one API key per line")
    p.add_argument("--max-body-bytes", type=int, default=65536,
                   help="larger request bodies are refused with 413 before they are read")
    p.add_argument("--drain-timeout-s", type=float, default=60.0,
                   help="on SIGTERM: how long running jobs may take to finish")
    p.add_argument("--ready-timeout-s", type=float, default=1800.0)
    p.add_argument("--join-timeout-s", type=float, default=60.0,
                   help="with --address: give up joining the cluster after this long")


def config_from_args(args: argparse.Namespace, gpus_per_rank: float) -> Any:
    from service.api.service import ServiceConfig
    from service.models.options import offload_options

    extra: dict[str, Any] = {"results_url": results_url(args), "group_timeout_s": args.group_timeout_s,
                             "storage_options": args.storage_options}
    extra["offload_options"] = offload_options(args, args.enable_distributed_layerwise_offload)
    return ServiceConfig(
        model=args.model,
        dp_size=args.data_parallel_size,
        sp_size=args.sequence_parallel_size,
        offload=args.enable_distributed_layerwise_offload,
        use_allgather=not args.dlo_no_use_allgather,
        cpus_per_rank=args.cpus_per_rank,
        gpus_per_rank=gpus_per_rank,
        strategy=args.placement_strategy,
        num_replicas=args.num_replicas,
        max_wait_ms=args.max_wait_ms,
        queue_size=args.queue_size,
        scheduler=args.scheduler,
        starve_s=args.starve_s,
        encoders_per_rank=args.encoders_per_rank,
        retention_s=args.retention_s,
        max_jobs=args.max_jobs,
        limits={
            "max_width": args.max_width,
            "max_height": args.max_height,
            "max_pixels": args.max_pixels,
            "max_frames": args.max_frames,
            "max_steps": args.max_steps,
        },
        deadline={
            "base_s": args.wave_deadline_base_s,
            "per_forward_s": args.wave_deadline_per_forward_s,
        },
        instance=uuid.uuid4().hex[:12],
        api_key_hashes=api_key_hashes(args),
        max_body_bytes=args.max_body_bytes,
        **extra,
    )


def results_url(args: argparse.Namespace) -> str:
    """The flag's URL (a relative folder made absolute: replicas run elsewhere), or one folder
    per instance: an instance is its port on this machine."""
    url = args.results_url or os.path.join("~", ".cache", "dloserve", "results", f"port-{args.port}")
    return url if "://" in url else os.path.abspath(os.path.expanduser(url))


def api_key_hashes(args: argparse.Namespace) -> list[str]:
    """SHA-256 of every key from --api-key, --api-key-file and DLOSERVE_API_KEYS; the keys
    themselves never leave this process (the Serve config carries only hashes)."""
    import hashlib

    keys = list(args.api_key or [])
    if args.api_key_file:
        keys += [ln.strip() for ln in open(args.api_key_file).read().splitlines()
                 if ln.strip() and not ln.startswith("#")]
    keys += [k.strip() for k in os.environ.get("DLOSERVE_API_KEYS", "").split(",") if k.strip()]
    return sorted({hashlib.sha256(k.encode()).hexdigest() for k in keys})
