"""``dloserve serve``: start (or join) Ray, deploy the Serve app, wait until ready, block.

    dloserve serve [MODEL] --data-parallel-size 2 --enable-distributed-layerwise-offload

With no MODEL the tiny demo model is served. RAY_ADDRESS (or --address) joins a running
cluster instead of starting a local one.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

import httpx


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="diffusers pipeline dir (default: demo)")
    p.add_argument("--data-parallel-size", type=int, default=1, help="DP ranks per group (N)")
    p.add_argument("--enable-distributed-layerwise-offload", action="store_true",
                   help="stream transformer blocks from host memory (DLO)")
    p.add_argument("--dlo-no-use-allgather", action="store_true",
                   help="rank-local DLO: every rank keeps whole blocks, no AllGather")
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
    p.add_argument("--encoders-per-rank", type=int, default=1,
                   help="MP4 encoder processes beside each rank (0: encode on the rank)")
    p.add_argument("--max-width", type=int, default=1280)
    p.add_argument("--max-height", type=int, default=1280)
    p.add_argument("--max-pixels", type=int, default=1280 * 720)
    p.add_argument("--max-frames", type=int, default=129)
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--wave-deadline-base-s", type=float, default=60.0,
                   help="fixed part of each request's deadline")
    p.add_argument("--wave-deadline-per-forward-s", type=float, default=10.0,
                   help="deadline = base + this x forwards x (pixels*frames / 832*480*81)")
    p.add_argument("--results-dir", default=None, help="job store folder")
    p.add_argument("--retention-s", type=float, default=86400.0, help="keep finished jobs this long")
    p.add_argument("--max-jobs", type=int, default=1000, help="keep at most this many jobs")
    p.add_argument("--ready-timeout-s", type=float, default=1800.0)


def config_from_args(args: argparse.Namespace, gpus_per_rank: float) -> Any:
    from service.api.service import ServiceConfig

    extra: dict[str, Any] = {}
    if args.results_dir:
        extra["results_dir"] = args.results_dir
    return ServiceConfig(
        model=args.model,
        dp_size=args.data_parallel_size,
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
        **extra,
    )


def run(args: argparse.Namespace) -> int:
    """Deploy and block until Ctrl-C; exit code 2 on bad flags or a model that cannot load."""
    if args.data_parallel_size < 1:
        print("dloserve serve: --data-parallel-size must be >= 1", file=sys.stderr)
        return 2
    if args.dlo_no_use_allgather and not args.enable_distributed_layerwise_offload:
        print("dloserve serve: --dlo-no-use-allgather needs "
              "--enable-distributed-layerwise-offload", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from service.models.adapter import ModelError, load_adapter
    from service.models.demo import resolve_model

    t0 = time.monotonic()
    try:
        args.model = resolve_model(args.model)  # the demo is written once, here
        load_adapter(args.model)
    except ModelError as e:
        print(f"dloserve serve: {e}", file=sys.stderr)
        return 2

    import ray
    from ray import serve

    from service.api.app import deploy

    joined = bool(args.address)
    ray.init(address=args.address or None, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    gpus = args.gpus_per_rank
    if gpus is None:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    cfg = config_from_args(args, gpus)
    print(f"deploying {cfg.model} DP{cfg.dp_size} "
          f"[{'DLO ' + ('allgather' if cfg.use_allgather else 'rank-local') if cfg.offload else 'resident'}"
          f", {'cuda' if gpus else 'cpu'}] ...", flush=True)
    deploy(cfg, args.host, args.port)
    url = f"http://{args.host}:{args.port}"
    try:
        _wait_ready(url, args.ready_timeout_s)
    except TimeoutError as e:
        print(f"dloserve serve: {e}", file=sys.stderr)
        return 1
    print(f"dloserve ready at {url} in {time.monotonic() - t0:.1f} s "
          f"(POST {url}/v1/videos, docs {url}/docs); Ctrl-C to stop", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping ...", flush=True)
    finally:
        serve.delete("dloserve")
        if not joined:
            serve.shutdown()
            ray.shutdown()
    return 0


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def _wait_ready(url: str, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < end:
        try:
            r = httpx.get(f"{url}/readyz", timeout=5)
            if r.status_code == 200:
                return
            last = r.text[:300]
        except httpx.HTTPError as e:
            last = str(e)
        time.sleep(0.5)
    raise TimeoutError(f"not ready after {timeout_s:.0f} s: {last}")
