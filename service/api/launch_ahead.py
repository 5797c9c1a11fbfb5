"""What ``dloserve serve`` starts ahead, beside Ray's and Serve's own start.

The model's check and the Serve app's import on threads while Ray starts; the warm hosts
(engine.warmhost) before Ray and the pre-started rank actors right after it; the job store
beside Serve's start; the CPUs per rank from the host. Each saves seconds of the start
(docs/operate.md, "Start-up time"). The handles of what was started are held here for the
service's life (Ray ends an actor whose handles are all gone) and stopped by ``stop``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.api.config import ServiceConfig


def check_model(args: argparse.Namespace, marks: dict[str, float]) -> Callable[[], str | None]:
    """Check the model (``check_start``; without MODEL it writes the demo one) on a thread:
    its seconds, mostly torch's import, overlap Ray's start instead of coming before it. The
    returned call waits for it, sets ``args.engine_config`` and ``args.model``, and returns
    the error that ends the start (exit code 2), or None. ``marks["model_checked"]``: when
    it was done (/readyz's ``startup.parallel``)."""
    out: dict[str, object] = {}

    def check() -> None:
        try:
            from service.models.adapter import ModelError
            from service.models.startup import check_start

            try:
                device = "cpu" if args.gpus_per_rank == 0 else "cuda"
                args.engine_config, _ = check_start(args.engine_config, args.model, device)
                args.model = args.engine_config.model_dir
            except ModelError as e:
                out["problem"] = str(e)
            marks["model_checked"] = time.time()
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            out["error"] = e

    t = threading.Thread(target=check, name="check-model", daemon=True)
    t.start()

    def result() -> str | None:
        t.join()
        if "error" in out:
            raise out["error"]  # type: ignore[misc]
        return out.get("problem")  # type: ignore[return-value]

    return result


def import_app() -> threading.Thread:
    """Import the Serve app's module (FastAPI, Serve, the service) on a thread while Ray
    starts: ``ray.init`` mostly waits for its daemons. A failed import is raised again by
    the ``import`` after ``join``."""
    def load() -> None:
        try:
            import service.api.app  # noqa: F401
        except BaseException:  # noqa: BLE001 - the main thread's import reports it
            pass

    t = threading.Thread(target=load, name="import-app", daemon=True)
    t.start()
    return t


def start_store(cfg: ServiceConfig) -> threading.Thread:
    """The job store's actor, started now on a thread, so its process and imports run beside
    Serve's start; the replica then finds it (the same name, the same settings). A failure
    is left to the replica, which reports it the same way."""
    def start() -> None:
        try:
            from service.api.service import connect_job_store

            connect_job_store(cfg)
        except Exception as e:  # noqa: BLE001 - the replica's own connect raises it again
            print(f"dloserve serve: the job store did not start beside Serve ({e}); the replica "
                  "tries again", file=sys.stderr, flush=True)

    t = threading.Thread(target=start, name="start-job-store", daemon=True)
    t.start()
    return t


def prestart_ranks(cfg: ServiceConfig, args: argparse.Namespace, own_cluster: bool) -> list[str]:
    """The rank processes, started now (engine.standby.prestart) so they import while Serve,
    its proxy and the ingress replica start; the replica's executor adopts them. Only on a
    cluster of our own with one replica (its one node runs every rank); ``--no-rank-prestart``
    leaves them to the executor."""
    if not prestarts(cfg, args, own_cluster):
        return []
    from service.engine.place import NAMESPACE
    from service.engine.standby import prestart

    hosts = warm_hosts.get("hosts")
    prestarted.update(prestart(cfg.engine_config(cfg.model), cfg.instance or "x", NAMESPACE, hosts))
    if hosts is not None:  # more hosts than processes (the config changed them): not needed
        hosts.close(keep=len(prestarted))
    return list(prestarted)


def start_hosts(args: argparse.Namespace, marks: dict[str, float]) -> None:
    """Warm hosts (engine.warmhost), started before Ray on a cluster of our own with one
    replica: one per rank process where the ranks will be pre-started, and one for the Serve
    app's replica. They import while Ray starts; the workers then run in them."""
    if args.num_replicas != 1:
        return
    # A share or several GPUs per rank: no one GPU to give a host before the placement exists,
    # and an import in it may load CUDA's driver (on the H200 one did), which fixes its view of
    # the GPUs; those ranks start as Ray's own processes.
    whole = args.gpus_per_rank in (None, 0, 1)
    from service.engine.warmhost import WarmHosts, gpu_per_process

    model = args.model if args.model and Path(args.model).expanduser().is_dir() else None
    sp = args.sequence_parallel_size
    count = args.data_parallel_size * sp if args.rank_prestart and whole else 0
    gpus = gpu_per_process(count, os.environ.get("CUDA_VISIBLE_DEVICES")) if args.gpus_per_rank != 0 else None
    warm_hosts["hosts"] = WarmHosts(count, model and str(Path(model).expanduser()), sp, gpus,
                                    ingress=INGRESS_MODULE)
    if count:
        marks["rank_hosts"] = warm_hosts["hosts"].started_at


def ingress_executable() -> str | None:
    """The Serve replica's worker command where a warm host waits for it, else None."""
    hosts = warm_hosts.get("hosts")
    return None if hosts is None else hosts.ingress_executable()


def prestarts(cfg: ServiceConfig, args: argparse.Namespace, own_cluster: bool) -> bool:
    """Whether the launcher starts the rank processes: where it knows the one node they run on."""
    return own_cluster and args.rank_prestart and cfg.num_replicas == 1


INGRESS_MODULE = "service.api.app"  # the Serve app's module: its host imports what it imports
prestarted: dict[str, object] = {}  # their handles, held for the service's life (Ray ends unheld actors)
warm_hosts: dict[str, Any] = {}  # "hosts": the WarmHosts started before Ray, stopped with the service


def size_ranks(args: argparse.Namespace, own_cluster: bool) -> None:
    """``--cpus-per-rank`` when not given: from the host on a cluster of our own (one node, all
    our ranks on it), else the old default of 1 (a joined cluster's nodes are shared)."""
    import ray

    from service.config.parallel import CPUS_PER_RANK, host_cpus_per_rank

    if args.cpus_per_rank is not None:
        args.cpus_per_rank_why = "--cpus-per-rank"
    elif own_cluster:
        ranks = args.data_parallel_size * args.sequence_parallel_size * args.num_replicas
        args.cpus_per_rank, args.cpus_per_rank_why = host_cpus_per_rank(
            ray.cluster_resources().get("CPU", 1.0), ranks)
    else:
        args.cpus_per_rank = CPUS_PER_RANK
        args.cpus_per_rank_why = "the default on a joined cluster (--cpus-per-rank sets it)"
    print(f"CPUs per rank: {args.cpus_per_rank:g} ({args.cpus_per_rank_why})", flush=True)


def stop() -> None:
    """Forget the pre-started ranks' handles and stop the warm hosts no worker came to (the
    rest ended with Ray)."""
    prestarted.clear()
    hosts = warm_hosts.pop("hosts", None)
    if hosts is not None:
        hosts.close()
