"""The HTTP front door, assembled: the FastAPI app of one replica (its OpenAPI document, the
middleware, the error handlers, the routes by resource) and the Serve application around it.

``build_app`` is also the Serve application builder for ``serve deploy`` config files
(``import_path: service.api.app:build_app``); ``deploy`` is what the CLI and the tests run.

The routes live in ``routes/`` (videos, models, LoRA adapters, the service's state), the
replica in ``deployment.py``, the errors' answers in ``errors.py`` and ``handlers.py``.
/healthz, /readyz and /openapi.json stay open; /readyz tells an anonymous caller ready or
not only (views.py). Every answer carries ``X-Content-Type-Options: nosniff`` and a
Cache-Control (``no-store`` unless the route says otherwise: an MP4 is ``private``).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from service.api import handlers
from service.api.deployment import VideoIngress
from service.api.http import NO_STORE, NOSNIFF, Uploads, error
from service.api.openapi import body_rules, instance_openapi
from service.api.origin import LOOPBACK_HOSTS, refusal
from service.api.routes import loras, models, status, videos
from service.api.routes.videos import CREATE_ERRORS as _CREATE_ERRORS  # noqa: F401 - tests read it here
from service.api.service import ServiceConfig, VideoService
from service.api.startup import Launched
from service.api.ui import HEADERS as PAGE_HEADERS
from service.api.ui import register as register_ui


def create_app(svc: VideoService | None = None, uploads: Uploads | None = None) -> FastAPI:
    """The app of one replica; its OpenAPI document states ``svc``'s limits (openapi.py).
    Without a service (the document's base, in tests): the routes, nothing to serve them."""
    # No /docs or /redoc: they load scripts from a CDN on the origin where /ui keeps the key
    # (the page at /ui and /openapi.json describe the API instead).
    app = FastAPI(title="dloserve", version="0.1.0", description="DiT video generation with DLO",
                  docs_url=None, redoc_url=None)
    register_ui(app)  # the playground at /ui/ (service/api/ui)
    handlers.install(app)
    app.middleware("http")(_origin)
    app.middleware("http")(_headers)
    for resource in (videos, models, loras, status):  # the OpenAPI document lists paths in this order
        app.include_router(resource.router)
    if svc is not None:
        app.state.svc, app.state.uploads = svc, uploads
        rules = body_rules(svc.adapter, svc.limits, svc.model_name)
        required = ("input_reference",) if svc.adapter.image_input == "required" else ()
        app.openapi_schema = instance_openapi(app.openapi(), rules, required)
    return app


async def _origin(request: Request, call_next: Any) -> Response:
    """Host and Origin checks (origin.py) before any route: 403 in the API's error shape."""
    svc = getattr(request.app.state, "svc", None)
    hosts = svc.cfg.allowed_hosts if svc is not None else []
    refused = refusal(request.method, request.headers, hosts)
    if refused is not None:
        param = "host" if refused[0] == "forbidden_host" else "origin"
        return error(403, refused[1], param, type="permission_error", code=refused[0], where="header")
    return await call_next(request)


async def _headers(request: Request, call_next: Any) -> Response:
    """Every answer names the DP group (replica) that gave it: which replica served a read
    is visible to operators and to the multi-node tests. And every answer is nosniff, and
    not cached unless the route said how."""
    response = await call_next(request)
    svc = getattr(request.app.state, "svc", None)
    if svc is not None:
        response.headers["x-dloserve-dp-group"] = svc.dp_group
    for name, value in NOSNIFF.items():
        response.headers.setdefault(name, value)
    if response.headers.get("content-type", "").startswith("text/html"):
        for name, value in PAGE_HEADERS.items():  # any HTML answer: the /ui page's CSP and all
            response.headers.setdefault(name, value)
    response.headers.setdefault("Cache-Control", NO_STORE)
    return response


def build_app(args: dict[str, Any], launched: Launched | None = None) -> Any:
    """Serve application builder: placement-group bundles come from the config; ``launched``:
    what ``dloserve serve`` did before (none from a Serve config file)."""
    cfg = ServiceConfig(**args)
    bundles = cfg.engine_config().parallel.bundles()
    return VideoIngress.options(
        num_replicas=cfg.num_replicas,
        placement_group_bundles=bundles,
        placement_group_strategy=cfg.placement_strategy,
    ).bind(cfg.model_dump(), launched, create_app)


def deploy(cfg: ServiceConfig, host: str, port: int, name: str = "dloserve",
           proxy_location: str = "EveryNode", launched: Launched | None = None,
           wait: bool = True) -> DeploymentHandle:
    """Start Serve on host:port (where the launcher has not) and run the app (used by the CLI
    and tests); ``wait=False`` returns once Serve has it, before its replicas are up (the
    launcher waits on /readyz). The launcher stamps ``serve_up`` in ``launched`` itself."""
    if host in LOOPBACK_HOSTS and not cfg.allowed_hosts:  # a loopback bind: loopback names only
        cfg = cfg.model_copy(update={"allowed_hosts": list(LOOPBACK_HOSTS)})
    serve.start(http_options={"host": host, "port": port}, proxy_location=proxy_location)
    app = build_app(cfg.model_dump(), launched)
    if wait:
        return serve.run(app, name=name, route_prefix="/")
    return serve.run_many([serve.RunTarget(app, name=name, route_prefix="/")],
                          wait_for_applications_running=False)[0]
