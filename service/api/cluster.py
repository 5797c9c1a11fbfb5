"""The Ray cluster a ``dloserve serve`` starts or joins, and its stop: what the launcher
started (``OWNED``) is what its stop takes, and nothing else. A cluster of its own goes
whole (every process it started); on a joined cluster only the app it deployed, its job
store and a Serve it started go, and the cluster lives on.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields

LOOPBACK = ("127.0.0.1", "localhost", "::1")
SERVE_REPLICA = "ray::ServeReplica"  # the process title of a Serve replica


class Stop(BaseException):
    """SIGINT or SIGTERM arrived: unwind, then clean up. A BaseException, as KeyboardInterrupt
    is: an ``except Exception`` on the way (a Ray hook's fallback, Ray's or Serve's own start-up)
    must not take a stop for a failure and carry on starting."""


@dataclass
class Owned:
    """What this launcher started."""

    cluster: bool = False  # a local cluster: its processes are our descendants
    ray: bool = False  # a ray.init we made
    deployed: bool = False  # our app and its job store
    serve: bool = False  # Serve, started by us on a joined cluster (it goes with us)
    store_url: str = ""  # our job store's results URL
    # Threads of ours that call Ray (the join, the job store's start): ray.shutdown() waits for
    # them, as Ray's core worker ends the whole process (code 1) when a call reaches it after.
    threads: list[threading.Thread] = field(default_factory=list)

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default_factory() if f.default_factory is not MISSING else f.default)

    def start_thread(self, target: Callable[..., None], name: str, *args: object) -> threading.Thread:
        """Run ``target`` on a daemon thread that ``shutdown`` waits for before ``ray.shutdown()``."""
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        self.threads.append(t)
        t.start()
        return t


OWNED = Owned()


def force_exit(code: int) -> None:
    """Exit now with ``code``, a cluster of our own killed first (a second signal, a hung stop)."""
    from service.api.hostproc import descendants, kill_tree

    if OWNED.cluster:
        kill_tree(descendants(os.getpid()), grace_s=2.0)
    os._exit(code)


def start_local(dashboard: bool = False) -> None:
    """A cluster of our own, always: never the one /tmp/ray/ray_current_cluster names.

    Ray's token authentication stays on (ray.init handles the token for this process and
    the workers it starts). Ray's dashboard only with ``--ray-dashboard`` (it binds
    127.0.0.1): ``ray.init`` waits for it and its module processes before it starts the
    raylet; without it Ray runs a minimal one. No runtime_env: the workers inherit this
    process's environment through the raylet, so Serve's controller, its proxy and the job
    store start as plain workers, not through the runtime-env agent. A watchdog
    (service/api/watchdog.py) stops the cluster's processes should this one be killed.
    """
    import ray

    OWNED.cluster = True  # from here on, our descendants are ours to stop
    OWNED.ray = True
    from service.api.watchdog import start_watchdog

    start_watchdog()  # a SIGKILL of this process leaves none of the cluster's behind
    os.environ["HF_HUB_OFFLINE"] = "1"
    # Serve's controller gives a new proxy 3 checks of this long to answer before it kills it and
    # serve.start fails (ActorDiedError): 5 s by default, missed once on this 2-core CPU machine
    # under other work, with the job store and the rank processes starting beside it.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")
    # Ray prestarts one idle worker per CPU when the first driver connects: on a 16-core H200
    # host 16 processes importing Ray at the end of ray.init, which they slowed by 1.7-2.5 s
    # (loadtest/results/h200-ray-start-2026-12-02.json); Serve's few actors start their own.
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    ctx = ray.init(address="local", include_dashboard=dashboard, dashboard_host="127.0.0.1")
    if not dashboard:  # Prometheus's list of endpoints, which the dashboard would write
        from service.api.metrics_discovery import write_service_discovery

        write_service_discovery(ctx.address_info["session_dir"])


def report_listeners(host: str) -> None:
    """Name our processes that listen beyond loopback. With a loopback --host only Serve's
    replica gRPC server should (Ray 2.60 binds it to [::]; Ray's token authentication refuses
    callers without the cluster's token); otherwise Ray's metrics export port answers anyone."""
    if not OWNED.cluster:
        return  # a joined cluster's listeners are its operator's
    from service.api.hostproc import descendants, listeners

    found = [x for x in listeners([os.getpid(), *descendants(os.getpid())]) if not x["loopback"]
             and not (host in LOOPBACK and str(x["process"]).startswith(SERVE_REPLICA))]
    names = ", ".join(f"{x['process']} {x['address']}:{x['port']}" for x in found)
    if found and host in LOOPBACK:
        print(f"dloserve serve: WARNING: with --host {host} these still listen beyond loopback: {names}",
              file=sys.stderr, flush=True)
    elif found:
        print(f"dloserve serve: WARNING: Ray listens on {len(found)} ports beyond loopback ({names}); its "
              "token authentication guards the control ports, but its metrics export port answers anyone: "
              "firewall it (docs/operate.md, 'Ray's ports')", file=sys.stderr, flush=True)


def join(address: str, timeout_s: float) -> str | None:
    """Join ``address`` within ``timeout_s``; an error naming it if that cannot be done."""

    import ray

    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if host and port.isdigit():
        import socket

        try:
            socket.create_connection((host, int(port)), timeout=min(timeout_s, 10.0)).close()
        except OSError as e:
            return f"cannot reach the Ray cluster at {address}: {e} (check --address / RAY_ADDRESS)"
    result: dict[str, BaseException | None] = {}

    def connect() -> None:
        try:
            OWNED.ray = True
            ray.init(address=address, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
            result["error"] = None
        except BaseException as e:  # noqa: BLE001 - reported below
            result["error"] = e

    t = OWNED.start_thread(connect, "ray-join")
    t.join(timeout_s)
    # Ray sends its token only where RAY_AUTH_MODE=token says so (or to address "auto"); a
    # cluster `ray start` made with ~/.ray/auth_token present refuses any other caller.
    token = "" if os.environ.get("RAY_AUTH_MODE", "").lower() == "token" else (
        "; if the cluster uses Ray's token authentication (`ray start` turns it on where "
        "~/.ray/auth_token exists), set RAY_AUTH_MODE=token (the token is read from ~/.ray/auth_token "
        "or RAY_AUTH_TOKEN), or pass --address auto for a cluster on this machine")
    if t.is_alive():
        return f"could not join the Ray cluster at {address} within {timeout_s:.0f} s{token}"
    if result.get("error") is not None:
        return f"could not join the Ray cluster at {address}: {result['error']}{token}"
    return None


def joined_serve() -> str | None:
    """On a joined cluster: the problem if a dloserve app runs there already (a second one would
    replace it); else note whether Serve runs (it keeps the HTTP port it was started with, and
    stays when we stop) or we start it (it goes with us)."""
    from ray import serve

    status = serve.status()
    if "dloserve" in status.applications:
        return ("an application named dloserve already runs on this cluster (another `dloserve serve`?); "
                "stop it first")
    OWNED.serve = not status.proxies
    return None


def shutdown(joined: bool, drain_s: float = 0.0, timeout_s: float = 60.0) -> None:
    """Drain, then stop what we started, within ``drain_s + timeout_s`` whatever hangs; a
    second signal forces it at once."""
    from service.api.hostproc import descendants, kill_tree

    watchdog = threading.Timer(drain_s + timeout_s, force_exit, args=(1,))
    watchdog.daemon = True
    watchdog.start()
    # Who is ours, before anything stops: Ray workers outlive their raylet for a while and
    # are then no longer our descendants.
    ours = descendants(os.getpid()) if OWNED.cluster else []
    try:
        import ray

        if OWNED.ray and ray.is_initialized() and OWNED.deployed:
            from ray import serve

            try:
                _drain(drain_s)
                if joined:  # the cluster lives on: our app and its job store (records stay) go
                    serve.delete("dloserve")
                    if OWNED.store_url:
                        from service.api.jobs import stop_store

                        stop_store(OWNED.store_url)
                    if OWNED.serve and not serve.status().applications:
                        serve.shutdown()  # Serve came with us: its proxies (and the port) go too
                # else reads answer until the cluster's processes (HTTP proxy among them) stop
            except Exception:  # noqa: BLE001 - half-started Serve: the process kill below ends it
                pass
        joined_by = time.monotonic() + timeout_s / 2  # one bound for all of them
        for t in OWNED.threads:
            t.join(max(0.0, joined_by - time.monotonic()))
        if OWNED.ray and ray.is_initialized() and not any(t.is_alive() for t in OWNED.threads):
            ray.shutdown()  # else the process's exit disconnects it (and a cluster of ours is killed below)
    except (Stop, SystemExit):
        pass
    finally:
        if OWNED.cluster:
            kill_tree(sorted(set(ours) | set(descendants(os.getpid()))), grace_s=5.0)
        watchdog.cancel()


def _drain(timeout_s: float) -> None:
    """New jobs get 503, queued ones fail now, running ones get ``timeout_s`` to finish."""
    from ray import serve

    try:
        app = serve.status().applications.get("dloserve")
        if app is None or app.status not in ("RUNNING", "UNHEALTHY"):
            return  # no replica took requests (a drain would wait for one to start, or fail)
        handle = serve.get_app_handle("dloserve")
    except Exception:  # noqa: BLE001 - never deployed: nothing to drain
        return
    print(f"draining (running jobs get up to {timeout_s:.0f} s) ...", file=sys.stderr, flush=True)
    try:
        done = handle.drain.remote(timeout_s).result(timeout_s=timeout_s + 30)
        print(f"drained: {done}", file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 - the app is deleted next anyway
        print(f"drain did not finish: {e}", file=sys.stderr, flush=True)
