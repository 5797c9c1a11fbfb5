"""``dloserve serve``: start (or join) Ray, deploy the Serve app, wait until ready, block.

    dloserve serve [MODEL] --data-parallel-size 2 --enable-distributed-layerwise-offload

With no MODEL the demo model is served. RAY_ADDRESS (or --address) joins a running cluster
(within --join-timeout-s); without one a new local cluster is started, never the last one
this machine ran, and with a loopback --host every Ray listener of it is on the loopback
address too (``service.api.cluster.start_local``). Either way the same public calls follow:
``serve.start``, ``serve.run_many`` (service.api.app.deploy), and the replica places its ranks in
its own placement group (engine.ray_executor). A busy port ends it with exit code 2 before
anything starts. SIGINT or SIGTERM at any moment stops the service and every process of a
cluster it started; reads of jobs answer until the HTTP proxy stops.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from service.api.cluster import (
    LOOPBACK,
    OWNED,
    Stop,
    force_exit,
    join,
    joined_serve,
    report_listeners,
    shutdown,
    start_local,
)
from service.api.serve_flags import (
    add_arguments,
    admin_key_hashes,
    api_key_hashes,
    config_from_args,
    results_url,
    webhook_settings,
)
from service.api.startup import Launched, process_started_at, uncompiled_imports

__all__ = ["add_arguments", "config_from_args", "run"]


@dataclass
class _Signals:
    """The stop signals seen: how many, whether the main thread is inside a Ray call, and the
    one that arrived there (acted on when the call returns)."""

    count: int = 0
    in_ray: bool = False
    pending: str = ""

    def reset(self) -> None:
        self.count, self.in_ray, self.pending = 0, False, ""


_signals = _Signals()


def _on_signal(signum: int, _frame: object) -> None:
    """First signal: unwind from wherever start-up is, but not from inside a Ray call: raised
    there it can land in Ray's C code (a SystemError instead of the stop) or leave a call half
    made, so it waits for the call to return (``_ray_call``). A second one: stop at once."""
    _signals.count += 1
    if _signals.count == 1:
        if _signals.in_ray:
            _signals.pending = signal.Signals(signum).name
            return
        raise Stop(signal.Signals(signum).name)
    print(f"dloserve serve: {signal.Signals(signum).name} again: stopping now", file=sys.stderr, flush=True)
    force_exit(130)


@contextmanager
def _ray_call() -> Iterator[None]:
    """A region of Ray calls on the main thread: a first signal inside it stops at its end."""
    _signals.in_ray = True
    try:
        yield
    finally:
        _signals.in_ray = False
    if _signals.pending:
        raise Stop(_signals.pending)


def _install_handlers() -> None:
    """Ours, again: ray.init replaces the SIGTERM handler with one that exits abruptly."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)


def run(args: argparse.Namespace) -> int:
    """Deploy and block until SIGINT/SIGTERM; exit code 2 on bad flags, a busy port, a model
    that cannot load or a cluster that cannot be joined."""
    from service.config import FlagError
    from service.config.args import EngineArgs
    from service.models.lora_ref import lora_flags

    try:  # every flag checked, in one order, before anything starts
        args.engine_config = EngineArgs.from_namespace(args).to_config()
        lora_flags(args)  # serve's form of --lora and the adapters' paths (their contents: the replica's)
    except FlagError as e:
        print(f"dloserve serve: {e}", file=sys.stderr)
        return 2
    # Signals stop the service from the very first moment, not only once it is ready.
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    _install_handlers()
    try:
        return _run(args)
    except (Stop, SystemExit) as e:  # SystemExit: ray.init's own SIGTERM handler, while it runs
        print(f"dloserve serve: {e or 'SIGTERM'} received, stopping ...", file=sys.stderr, flush=True)
        return 0  # a requested stop is not an error
    finally:
        shutdown(bool(args.address), drain_s=args.drain_timeout_s)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _signals.reset()
        OWNED.reset()


def _run(args: argparse.Namespace) -> int:
    # /readyz's startup breakdown (service.api.startup): from this process's start, as a user times it
    marks = {"command": time.time()}
    marks["process"] = process_started_at() or marks["command"]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not args.address and args.host in LOOPBACK and "ray" not in sys.modules:
        # Ray's single-machine mode (meant for laptops; on Linux it does the same): the node's
        # address is the loopback one, so every Ray listener binds it. Ray reads the variable
        # when it is imported (a driver that imported it before would look for its node at the
        # host's address while the raylet took the loopback one), so only before that; else
        # the listener report names what binds the host's address.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    model_checked = _beside_ray(args, marks)  # imports and the model's check beside Ray's and Serve's start
    if args.model and not Path(args.model).expanduser().is_dir():  # no folder: said before anything starts
        problem = model_checked()
        if problem:
            print(f"dloserve serve: {problem}", file=sys.stderr)
            return 2
    problem = _check_keys_and_storage(args)
    if problem:
        print(f"dloserve serve: {problem}", file=sys.stderr)
        return 2
    slow_imports = uncompiled_imports()
    if slow_imports:
        print(f"dloserve serve: WARNING: {slow_imports}", file=sys.stderr, flush=True)
    if problem := _port_taken(args, serve_may_hold=bool(args.address)):
        print(f"dloserve serve: {problem}", file=sys.stderr)
        return 2
    marks["checked"] = time.time()
    if args.address:
        with _ray_call():
            err = join(args.address, args.join_timeout_s)
        if err:
            print(f"dloserve serve: {err}", file=sys.stderr)
            return 2
    else:
        with _ray_call():  # (ray.init's own SIGTERM handler raises SystemExit while it runs)
            start_local(dashboard=args.ray_dashboard)
            _install_handlers()  # ours again: ray.init replaced SIGTERM's
    model_checked(stage="serve")  # Serve's modules in: its start runs beside the rest of the imports
    from ray import serve

    with _ray_call():
        problem = joined_serve() if args.address else None
    if args.address and not problem and OWNED.serve:  # no Serve there: the proxy was another's
        problem = _port_taken(args, serve_may_hold=False)
    if problem:
        print(f"dloserve serve: {problem}", file=sys.stderr)
        return 2
    marks["ray_up"] = time.time()
    OWNED.deployed = True  # from here on, Serve (if we start it), the app and its job store are ours to stop
    with _ray_call():
        serve.start(http_options={"host": args.host, "port": args.port}, proxy_location="EveryNode")
    marks["serve_up"] = time.time()
    problem = model_checked(stage="imports")
    if problem:  # the cluster we started goes with the launcher (run's finally)
        print(f"dloserve serve: {problem}", file=sys.stderr)
        return 2

    import ray

    with _ray_call():
        gpus = args.gpus_per_rank
        if gpus is None:
            gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
        _size_ranks(args, OWNED.cluster)
        cfg = config_from_args(args, gpus, args.engine_config)
    OWNED.start_thread(_start_store, "start-job-store", cfg)
    from service.api.app import deploy

    OWNED.store_url = cfg.results_url
    mode = cfg.offload["mode"]
    sp = cfg.sequence_parallel_size
    print(f"deploying {cfg.model} DP{cfg.data_parallel_size}{f' x SP{sp}' if sp > 1 else ''} "
          f"[{'resident' if mode == 'resident' else 'DLO ' + mode}, {cfg.scheduler}, "
          f"{'cuda' if gpus else 'cpu'}] ...", flush=True)
    with _ray_call():  # the app's deploy is waited for below, where a signal stops it
        deploy(cfg, args.host, args.port, launched=Launched(marks), wait=False)
    url = f"http://{args.host}:{args.port}"
    try:
        _wait_ready(url, cfg.instance or "", args.ready_timeout_s,
                    serve_before=bool(args.address) and not OWNED.serve)
    except (TimeoutError, NotServing) as e:
        print(f"dloserve serve: {e}", file=sys.stderr)
        return 2 if isinstance(e, NotServing) else 1
    report_listeners(args.host)
    print(f"dloserve ready at {url} in {time.time() - marks['process']:.1f} s "
          f"(POST {url}/v1/videos, the playground {url}/ui); Ctrl-C to stop", flush=True)
    while True:
        time.sleep(3600)


def _beside_ray(args: argparse.Namespace, marks: dict[str, float]) -> Callable[..., str | None]:
    """On a thread: import what Serve's start needs (Serve, FastAPI, pydantic.v1), check the
    model (``check_start``; without MODEL the committed demo model), then import the Serve app's
    module. Their seconds (mostly Serve's and FastAPI's imports: none imports torch) overlap the
    launcher's checks, Ray's start (mostly waiting for its daemons) and Serve's. The returned
    call waits for a ``stage``: ``serve`` (Serve's modules: a Ray call may run beside the rest;
    a Ray call's first serialization imports pydantic.v1, and that import beside FastAPI's once
    failed with KeyError 'pydantic.v1'), ``check`` (sets ``args.engine_config`` and ``args.model``;
    returns the error that ends the start, exit 2, or None) or ``imports`` (and the app's module).
    ``marks["model_checked"]``: when the check was done (/readyz's ``startup.parallel``)."""
    out: dict[str, object] = {}
    stages = {stage: threading.Event() for stage in ("serve", "check", "imports")}

    def check() -> None:
        try:
            import fastapi  # noqa: F401
            import pydantic.v1  # noqa: F401
            from ray import serve  # noqa: F401
        except BaseException:  # noqa: BLE001 - the main thread's import reports it
            pass
        stages["serve"].set()
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
        stages["check"].set()
        try:
            import service.api.app  # noqa: F401
        except BaseException:  # noqa: BLE001 - the main thread's import reports it
            pass
        stages["imports"].set()

    threading.Thread(target=check, name="beside-ray", daemon=True).start()

    def result(stage: str = "check") -> str | None:
        stages[stage].wait()
        if stage == "serve":
            return None
        if "error" in out:
            raise out["error"]  # type: ignore[misc]
        return out.get("problem")  # type: ignore[return-value]

    return result


def _check_keys_and_storage(args: argparse.Namespace) -> str | None:
    """The keys, the webhook settings and the results folder, checked (warnings said); the
    problem that ends the start, or None."""
    from service.api.keys import MIN_KEY_CHARS, KeyFileError, short_keys
    from service.api.serve_flags import key_entries
    from service.api.store import StoreLocked, lock_folder
    from service.api.webhooks import WebhookConfigError

    try:
        keys = api_key_hashes(args)
        admin_key_hashes(args)
        webhook_settings(args)
    except (OSError, KeyFileError, WebhookConfigError) as e:
        return str(e)
    short = short_keys(e.key for e in key_entries(args))
    if short:
        print(f"dloserve serve: WARNING: {short} API key(s) shorter than {MIN_KEY_CHARS} characters: a short "
              "key can be guessed; use long random ones (e.g. `openssl rand -hex 24`)", file=sys.stderr,
              flush=True)
    if not keys:
        print("dloserve serve: WARNING: no --api-key given: any client that reaches the port can read, "
              "download and delete every job made without a key (jobs a key made stay that key's)",
              file=sys.stderr, flush=True)
    if args.api_key or args.admin_key:
        print("dloserve serve: note: keys given as --api-key/--admin-key are visible to every user of "
              "this machine in the process list; use --api-key-file/--admin-key-file (or "
              "DLOSERVE_API_KEYS) instead", file=sys.stderr, flush=True)
    url = results_url(args)
    if args.results_url is None:  # the default per-port folders: stopped instances' are cleaned
        from service.api.cleanup import clean_results

        for gone in clean_results(Path(url).parent, Path(url), args.retention_s):
            print(f"removed the results folder of a stopped instance: {gone}", file=sys.stderr, flush=True)
    try:
        if "://" not in url and not args.address:  # joined: the cluster's store may hold it
            lock_folder(Path(url)).close()
        else:
            from service.api.results import open_storage

            open_storage(url, args.storage_options)  # unreachable or no driver: say so now
    except StoreLocked as e:
        return str(e)
    except ValueError as e:
        return f"--results-url: {e}"
    return None


def _start_store(cfg: object) -> None:
    """The job store's actor, started beside Serve's start (its process and imports); the
    replica then finds it (the same name, the same settings). A failure is left to the
    replica, which reports it the same way."""
    try:
        from service.api.service import connect_job_store

        connect_job_store(cfg)  # type: ignore[arg-type]
    except Exception as e:  # noqa: BLE001 - the replica's own connect raises it again
        print(f"dloserve serve: the job store did not start beside Serve ({e}); the replica "
              "tries again", file=sys.stderr, flush=True)


def _size_ranks(args: argparse.Namespace, own_cluster: bool) -> None:
    """``--cpus-per-rank`` when not given: from the host on a cluster of our own (one node, all
    our ranks on it), else the default of 1 (a joined cluster's nodes are shared)."""
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


def _port_taken(args: argparse.Namespace, serve_may_hold: bool) -> str | None:
    """Why ``--port`` cannot be Serve's (something listens there), or None. ``serve_may_hold``:
    joining a cluster, where Serve may run already with its proxy on this port (the port we
    then serve on); asked again after the join if no Serve runs there."""
    from service.api.hostproc import port_free, port_holder

    if port_free(args.host, args.port):
        return None
    holder = port_holder(args.port)
    if serve_may_hold and holder and "ray::ProxyActor" in holder:
        return None
    return (f"port {args.port} on {args.host} is already in use{f' by {holder}' if holder else ''}; "
            "choose another with --port")


class NotServing(RuntimeError):
    """The app will not serve on our port: its deploy failed, another service answers there (it
    listens with SO_REUSEPORT, as Serve does), or Serve answers on another port than ours (it ran
    on the joined cluster before us)."""


def _wait_ready(url: str, instance: str, timeout_s: float, serve_before: bool = False) -> None:
    """Until ``url``/readyz answers 200 for ``instance``; the app's state is asked once a second
    (``_app_problem``)."""
    end = time.monotonic() + timeout_s
    last, asked = "no answer", 0.0
    while time.monotonic() < end:
        refused = False
        try:
            r = httpx.get(f"{url}/readyz", timeout=5)
            body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
            other = body.get("instance")
            if other and other != instance:
                raise NotServing(f"{url} is answered by another dloserve instance ({other}): "
                                 f"its port is shared; choose another with --port")
            if r.status_code == 200 and other == instance:
                return
            last = r.text[:300]
        except httpx.ConnectError as e:
            last, refused = str(e), True
        except httpx.HTTPError as e:
            last = str(e)
        if time.monotonic() - asked > 1.0:
            asked = time.monotonic()
            problem = _app_problem(url, unanswered=refused and serve_before)
            if problem:
                raise NotServing(problem)
        time.sleep(0.1)  # ready is printed within 0.1 s of it
    raise TimeoutError(f"not ready after {timeout_s:.0f} s: {last}")


def _app_problem(url: str, unanswered: bool) -> str | None:
    """Why the app will not serve on ``url``, as Serve tells it: its deploy failed, or it runs
    while nothing answers on our port (``unanswered``, where Serve ran on the joined cluster
    before us: its proxies keep the port it was started with, whatever --port says)."""
    from ray import serve

    try:
        with _ray_call():
            app = serve.status().applications.get("dloserve")
    except Exception:  # noqa: BLE001 - Serve's controller restarting: asked again in a second
        return None
    if app is None:
        return None
    if app.status == "DEPLOY_FAILED":  # each deployment's message ends with its error's own line
        causes = [d.message.strip().splitlines()[-1] for d in app.deployments.values() if d.message.strip()]
        return f"the app failed to deploy: {'; '.join(causes) or app.message}"
    if unanswered and app.status == "RUNNING":
        return (f"nothing answers on {url}, yet the app runs: Serve was running on this cluster before, "
                "and its proxies keep the HTTP port it was started with; pass that port as --port, or "
                "stop Serve first (`serve shutdown`)")
    return None
