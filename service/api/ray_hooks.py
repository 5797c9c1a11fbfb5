"""Every use of Ray's private modules, in one place, each beside its public fallback.

The launcher reaches past Ray's public API in four places; each is worth it only while it
works, so each is tried only on the Ray it was written against (``TESTED``), never with
``DLOSERVE_RAY_PUBLIC=1`` (a CI test starts ``dloserve serve`` so), and any exception in it,
not only an ImportError, falls back to the public way with one line on stderr:

- ``loopback_node``: Ray's single-machine mode, so a loopback ``--host`` keeps Ray's
  listeners on 127.0.0.1. Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when it is
  imported; the private hook also sets the constant it was read into (Ray is often
  imported by then). Public: the variable alone (where Ray was imported first, its
  listeners bind the host's address; the launcher's listener report names them).
- ``start_controller``: Serve's controller without waiting for its HTTP proxies, which then
  start beside the replica (2-3 s of an H200's start). Public: ``serve.start``, which waits.
- ``stop_http``: Serve's controller, then its proxies, killed by name, so clients get a
  refused connection, never a 404 from a proxy whose app went first. Public:
  ``serve.shutdown``.
- ``session_dirs`` and ``autoscaler_metrics_address``: where Ray's dashboard would write
  Prometheus's list of endpoints. Public: Ray's temp folder and its ``session_latest``
  link, and no autoscaler entry.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

PUBLIC_ENV = "DLOSERVE_RAY_PUBLIC"  # 1: Ray's public API only
TESTED = ("2.60.",)  # the Ray versions the private hooks were written against
_said: set[str] = set()


def private_ok() -> bool:
    """Whether the private hooks may be tried: a tested Ray, and not turned off."""
    import ray

    if os.environ.get(PUBLIC_ENV, "") not in ("", "0"):
        _say("public", f"{PUBLIC_ENV}={os.environ[PUBLIC_ENV]}: Ray's public API only")
        return False
    if not ray.__version__.startswith(TESTED):
        _say("public", f"Ray {ray.__version__} (private hooks written for {', '.join(TESTED)}x): "
                       "Ray's public API only")
        return False
    return True


def _say(key: str, line: str) -> None:
    if key not in _said:
        _said.add(key)
        print(f"dloserve serve: {line}", file=sys.stderr, flush=True)


def _fell_back(hook: str, error: BaseException) -> None:
    _say(hook, f"{hook}: Ray's private hook failed ({type(error).__name__}: {error}); its public "
               "fallback runs instead")


def loopback_node() -> None:
    """Ray's single-machine mode: the node's address is the loopback one (before ray.init)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    if private_ok():
        try:
            from ray._private import ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = False  # read at import: ray may be imported already
        except Exception as e:  # noqa: BLE001 - any failure: the variable alone
            _fell_back("loopback_node", e)


def start_controller(http_options: dict[str, Any], proxy_location: str) -> list[Any]:
    """Start Serve's controller and return its proxies' ``ready`` calls, not waited for; []
    where Serve ran already or ``serve.start`` did the wait."""
    from ray import serve

    if private_ok():
        try:
            return _start_controller(http_options, proxy_location)
        except Exception as e:  # noqa: BLE001 - any failure: Serve's public start
            _fell_back("start_controller", e)
    serve.start(http_options=http_options, proxy_location=proxy_location)
    return []


def _start_controller(http_options: dict[str, Any], proxy_location: str) -> list[Any]:
    from ray import serve
    from ray.serve._private.api import _coerce_controller_options, _create_controller_and_proxy_refs
    from ray.serve._private.client import ServeControllerClient
    from ray.serve.context import _get_global_client, _set_global_client

    if _get_global_client(raise_if_no_controller_running=False) is not None:
        serve.start(http_options=http_options, proxy_location=proxy_location)  # says if options differ
        return []
    controller, ready = _create_controller_and_proxy_refs(
        http_options, None, None, None, _coerce_controller_options(None), proxy_location)
    _set_global_client(ServeControllerClient(controller))
    return list(ready)


def wait_proxies(ready: list[Any], timeout_s: float) -> None:
    """Wait for the proxies' ``ready`` calls; a proxy that failed raises its error, one that
    does not answer in ``timeout_s`` a TimeoutError."""
    import ray

    if not ready:
        return
    try:
        ray.get(ready, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"Serve's HTTP proxies did not start within {timeout_s:.0f} s") from None


def stop_http() -> None:
    """End Serve's HTTP before anything behind it (the controller first: it would start a new
    proxy; then the proxies)."""
    from ray import serve

    if private_ok():
        try:
            _stop_http()
            return
        except Exception as e:  # noqa: BLE001 - any failure: Serve's public shutdown
            _fell_back("stop_http", e)
    serve.shutdown()


def _stop_http() -> None:
    import time

    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE, SERVE_PROXY_NAME

    def kill(name: str) -> None:
        try:
            ray.kill(ray.get_actor(name, namespace=SERVE_NAMESPACE), no_restart=True)
        except ValueError:
            return  # not running
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                ray.get_actor(name, namespace=SERVE_NAMESPACE)
            except ValueError:
                return  # gone: its name is free
            time.sleep(0.05)

    proxies = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if a.get("namespace") == SERVE_NAMESPACE and a["name"].startswith(SERVE_PROXY_NAME)]
    kill(SERVE_CONTROLLER_NAME)
    for name in proxies:
        kill(name)


def session_dirs() -> tuple[Path, Path]:
    """This driver's Ray session folder and Ray's temp folder."""
    if private_ok():
        try:
            import ray

            node = ray._private.worker.global_worker.node
            return Path(node.get_session_dir_path()), Path(node.get_temp_dir_path())
        except Exception as e:  # noqa: BLE001 - any failure: the folders Ray names by default
            _fell_back("session_dirs", e)
    temp = Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / "ray"  # Ray's own default
    return (temp / "session_latest").resolve(), temp


def autoscaler_metrics_address() -> str | None:
    """The autoscaler's metrics endpoint where it has one (None on the public path)."""
    if private_ok():
        try:
            from ray.experimental.internal_kv import _internal_kv_get

            found = _internal_kv_get(b"AutoscalerMetricsAddress")
            return found.decode() if found else None
        except Exception as e:  # noqa: BLE001 - any failure: no autoscaler entry
            _fell_back("autoscaler_metrics_address", e)
    return None
