"""Serve's controller started without waiting for its HTTP proxies first.

``serve.start`` returns once every proxy has answered ``ready``: a worker process, Serve's
proxy imports and uvicorn's bind, 2-3 s of an H200's start. Deploying the app needs only
the controller, so ``deploy`` starts it, deploys, and waits for the proxies after: their
start runs beside the ingress replica's. Ray 2.60's own helpers do it (``serve.start``
splits the same two steps); a Ray without them gets ``serve.start``.
"""

from __future__ import annotations

from typing import Any

import ray
from ray import serve


def start_controller(http_options: dict[str, Any], proxy_location: str) -> list[Any]:
    """Start Serve's controller (here: none runs yet) and return its proxies' ``ready``
    calls, not waited for; [] where Serve ran already or ``serve.start`` did the wait."""
    try:
        from ray.serve._private.api import _coerce_controller_options, _create_controller_and_proxy_refs
        from ray.serve._private.client import ServeControllerClient
        from ray.serve.context import _get_global_client, _set_global_client
    except ImportError:  # another Ray: its public start, which waits
        serve.start(http_options=http_options, proxy_location=proxy_location)
        return []
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
    if not ready:
        return
    try:
        ray.get(ready, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"Serve's HTTP proxies did not start within {timeout_s:.0f} s") from None
