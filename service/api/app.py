"""FastAPI routes behind a Ray Serve ingress; one replica owns one engine (its rank groups).

No ``from __future__ import annotations`` here: Serve re-wraps the route methods and
FastAPI must see real types, not strings.

``build_app`` is also the Serve application builder for ``serve deploy`` config files
(``import_path: service.api.app:build_app``). The replica itself asks for no CPU and
rides in bundle 0 of the placement group Serve reserves for it from
``placement_group_bundles``; the N worker actors take the N bundles.

Every /v1 route asks ``_owner`` first (API keys, when configured); /healthz, /readyz and
/openapi.json stay open. Bodies are read against ``max_body_bytes``: a declared length
over it is refused before reading, a stream that grows past it is cut off at the cap.
"""

import asyncio
import logging
from typing import Any, Literal

import ray
from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api.catalog import ModelCard, ModelList, model_card
from service.api.images import ImageTooLarge, body_cap, create_body
from service.api.openapi import body_rules, instance_openapi
from service.api.records import JobRecord, JobStatus
from service.api.schemas import (
    BodyError,
    ErrorResponse,
    MediaTypeError,
    Video,
    VideoCreate,
    VideoDeleted,
    VideoList,
    media_type,
    parse_body,
)
from service.api.service import AuthError, ServiceConfig, VideoService, video_object
from service.api.ui import register as register_ui
from service.engine.metrics import metrics
from service.router.dispatcher import Unavailable
from service.router.waves import QueueFull

log = logging.getLogger("dloserve.api")
app = FastAPI(title="dloserve", version="0.1.0", description="DiT video generation with DLO")

_CREATE_BODY = create_body(VideoCreate.model_json_schema())  # input_reference: a string, or a file part
_ERR = {"model": ErrorResponse}
_AUTH = {401: {**_ERR, "description": "missing or unknown API key"}}
_CREATE_ERRORS = {**_AUTH, 413: {**_ERR, "description": "body (or its image) over the size limit"},
                  415: {**_ERR, "description": "not JSON or a form"},
                  422: {**_ERR, "description": "a field is invalid (param names it)"},
                  429: {**_ERR, "description": "queue full; see Retry-After"},
                  503: {**_ERR, "description": "draining, or no rank group can serve; see Retry-After"}}
_BY_ID = {**_AUTH, 404: {**_ERR, "description": "no such video (or another key's)"}}
register_ui(app)  # the playground at /ui/ (service/api/ui)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (404 route, 405 method) in the OpenAI shape; a 405 lists every
    method the path has (Starlette names only those of the first route that matched)."""
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        path, root = request.scope.get("path", ""), request.scope.get("root_path", "")
        path = path[len(root):] if root and path.startswith(root) else path
        methods: set[str] = set()
        for route in app.router.routes:
            if isinstance(route, APIRoute) and route.path_regex.match(path):
                methods |= route.methods
        headers["Allow"] = ", ".join(sorted(methods))
    return _error(exc.status_code, str(exc.detail), None, code=f"http_{exc.status_code}", headers=headers)


@app.middleware("http")
async def _answered_by(request: Request, call_next: Any) -> Response:
    """Every answer names the DP group (replica) that gave it: which replica served a read
    is visible to operators and to the multi-node tests. (The replica's id is its DP group's
    id; asked from Serve here because the class's globals travel pickled by value.)"""
    response = await call_next(request)
    try:
        response.headers["x-dloserve-dp-group"] = serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a replica (plain FastAPI test client)
        pass
    return response


class TooLarge(Exception):
    """The body is over the limit (413)."""


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI-style error body, plus FastAPI's ``detail`` list so both kinds of client read it."""
    body: dict[str, Any] = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    if param is not None:
        body["detail"] = [{"loc": ["body", param], "msg": message, "type": code or kind}]
    return JSONResponse(body, status_code=status, headers=headers)


async def read_capped(request: Request, cap: int) -> bytes:
    """The body, never reading more than ``cap`` + one chunk of it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise TooLarge(f"body of {declared} bytes is over the limit of {cap}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise TooLarge(f"body is over the limit of {cap} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256,
                  health_check_period_s=5, health_check_timeout_s=30)
@serve.ingress(app)
class VideoIngress:
    def __init__(self, config: dict[str, Any]) -> None:
        from service.engine.metrics import log_to_stderr

        log_to_stderr()
        self.svc = VideoService(
            ServiceConfig(**config), placement_group=ray.util.get_current_placement_group(),
            dp_group=serve.get_replica_context().replica_id.unique_id,
        )
        if not self.svc.cfg.api_key_hashes:
            log.warning("no API key configured: every client can read and delete every job")
        rules = body_rules(self.svc.adapter, self.svc.limits, self.svc.model_name)
        app.openapi_schema = None
        required = ("input_reference",) if self.svc.adapter.image_input == "required" else ()
        app.openapi_schema = instance_openapi(app.openapi(), rules, required)

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine cannot serve is reported unhealthy."""
        problem = self.svc.health_problem()
        if problem:
            raise RuntimeError(problem)

    def _owner(self, request: Request) -> str | None | JSONResponse:
        try:
            return self.svc.owner_of(request.headers.get("authorization"))
        except AuthError as e:
            return _error(401, str(e), None, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _create(self, request: Request) -> JobRecord | JSONResponse:
        """The job record as accepted, or the 401/413/415/422/429/503 answer."""
        owner = self._owner(request)
        if isinstance(owner, JSONResponse):
            return owner
        draining = self.svc.draining()
        if draining:
            return _error(503, draining, None, kind="server_error", code="draining",
                          headers={"Retry-After": "30"})
        ctype = request.headers.get("content-type", "")
        cfg = self.svc.cfg
        try:
            cap = body_cap(media_type(ctype), cfg.max_body_bytes, cfg.max_image_bytes,
                           self.svc.adapter.image_input != "none")
            raw = await read_capped(request, cap)
            fields = await parse_body(ctype, raw)
            # create() writes the job record under a lock the dispatcher shares: keep it
            # off the event loop so status polls are not held up behind it.
            return await asyncio.to_thread(self.svc.create, fields, owner)
        except MediaTypeError as e:
            return _error(415, str(e), None, code="unsupported_media_type")
        except TooLarge as e:
            metrics()["requests"].inc(1, tags={"status": "rejected"})
            return _error(413, str(e), None, code="body_too_large")
        except ImageTooLarge as e:
            metrics()["requests"].inc(1, tags={"status": "rejected"})
            return _error(413, e.message, e.field, code=e.kind)
        except BodyError as e:
            metrics()["requests"].inc(1, tags={"status": "rejected"})
            return _error(422, e.message, e.field, code=e.kind)
        except QueueFull as e:
            metrics()["requests"].inc(1, tags={"status": "throttled"})
            return _error(429, str(e), kind="rate_limit_error", code="queue_full",
                          headers={"Retry-After": str(e.retry_after_s)})
        except Unavailable as e:
            metrics()["requests"].inc(1, tags={"status": "refused_down"})
            return _error(503, str(e), kind="server_error", code="engine_down",
                          headers={"Retry-After": str(e.retry_after_s)})

    @app.post("/v1/videos", status_code=202, openapi_extra=_CREATE_BODY, response_model=Video,
              responses=_CREATE_ERRORS)
    async def create_video(self, request: Request) -> JSONResponse:
        """Queue a generation job (JSON or multipart, as the openai client sends)."""
        rec = await self._create(request)
        if isinstance(rec, JSONResponse):
            return rec
        return JSONResponse(video_object(rec), status_code=202)

    @app.post("/v1/videos/sync", openapi_extra=_CREATE_BODY, response_class=Response,
              responses={200: {"content": {"video/mp4": {}}, "description": "the MP4"},
                         **_CREATE_ERRORS, 500: {**_ERR, "description": "generation failed"}})
    async def create_video_sync(self, request: Request) -> Response:
        """Generate and answer the MP4 itself; the job is also listed under /v1/videos.

        The job id is in the ``x-video-id`` header. A failed job answers 500 with the reason;
        a client that disconnects does not cancel the job (fetch it by id later).
        """
        rec = await self._create(request)
        if isinstance(rec, JSONResponse):
            return rec
        vid, owner = rec.id, rec.owner
        while True:
            final = await asyncio.to_thread(self.svc.get, vid, owner)  # a call to the job store
            if final is None:
                return _error(404, f"video {vid} was deleted before it finished", "video_id",
                              code="not_found")
            if final.final:
                break
            await asyncio.sleep(0.1)
        headers = {"x-video-id": vid}
        if final.status is not JobStatus.COMPLETED:
            err = final.error or {}
            return _error(500, err.get("message", "generation failed"), None, kind="server_error",
                          code=err.get("code", "generation_failed"), headers=headers)
        gone = f"video {vid} has no content (expired or deleted)"
        video = await asyncio.to_thread(self._video, vid, headers)  # S3: network calls
        return video or _error(404, gone, "video_id", code="not_found", headers=headers)

    def _video(self, vid: str, headers: dict[str, str] | None = None) -> Response | None:
        """The MP4 from the results storage, whichever replica stored it; None if it is gone.

        A local folder is sent as a file (ranges, sendfile); any other URL is streamed."""
        storage = self.svc.storage
        path = storage.video_path(vid)
        if path is not None:
            return FileResponse(path, media_type="video/mp4", filename=f"{vid}.mp4", headers=headers)
        if storage.local_path is not None or not storage.has_video(vid):
            return None
        name = f"{vid}.mp4"
        head = {**(headers or {}), "content-length": str(storage.size(name)),
                "content-disposition": f'attachment; filename="{name}"'}
        return StreamingResponse(storage.chunks(name), media_type="video/mp4", headers=head)

    @app.get("/v1/videos", response_model=VideoList, responses=_AUTH)
    def list_videos(
        self,
        request: Request,
        after: str | None = Query(None, max_length=64),
        limit: int = Query(20, ge=1, le=100),
        order: Literal["asc", "desc"] = "desc",
    ) -> Any:
        owner = self._owner(request)
        if isinstance(owner, JSONResponse):
            return owner
        recs, more = self.svc.list(after, limit, order, owner)
        data = [video_object(r) for r in recs]
        return VideoList.model_validate({
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        })

    @app.get("/v1/videos/{video_id}", response_model=Video, responses=_BY_ID)
    def retrieve_video(self, request: Request, video_id: str) -> Any:
        owner = self._owner(request)
        if isinstance(owner, JSONResponse):
            return owner
        rec = self.svc.get(video_id, owner)
        if rec is None:
            return _error(404, f"no video {video_id!r}", "video_id", code="not_found")
        headers = {"openai-poll-after-ms": "250"} if not rec.final else {}
        return JSONResponse(video_object(rec), headers=headers)

    @app.get("/v1/videos/{video_id}/content", response_class=Response,
             responses={200: {"content": {"video/mp4": {}}, "description": "the MP4"}, **_BY_ID,
                        409: {**_ERR, "description": "not completed"}})
    def video_content(self, request: Request, video_id: str, variant: Literal["video"] = "video") -> Any:
        owner = self._owner(request)
        if isinstance(owner, JSONResponse):
            return owner
        rec = self.svc.get(video_id, owner)
        if rec is None:
            return _error(404, f"no video {video_id!r}", "video_id", code="not_found")
        if rec.status is not JobStatus.COMPLETED:
            return _error(409, f"video {video_id} is {rec.status.value}", "video_id", code="not_ready")
        return self._video(video_id) or _error(
            404, f"video {video_id} has no content (expired or deleted)", "video_id", code="not_found")

    @app.delete("/v1/videos/{video_id}", response_model=VideoDeleted, responses=_BY_ID)
    def delete_video(self, request: Request, video_id: str) -> Any:
        """Delete a job; one that is running is cancelled instead (``deleted`` false): it stops
        at its next transformer forward and ends ``cancelled``."""
        owner = self._owner(request)
        if isinstance(owner, JSONResponse):
            return owner
        result = self.svc.delete(video_id, owner)
        if result == "missing":
            return _error(404, f"no video {video_id!r}", "video_id", code="not_found")
        return VideoDeleted(id=video_id, deleted=result == "deleted")

    @app.get("/v1/models", response_model=ModelList, responses=_AUTH)
    def list_models(self, request: Request) -> Any:
        """The model this service runs: its family and what it accepts (T2V, I2V, TI2V, image)."""
        owner = self._owner(request)
        if isinstance(owner, JSONResponse):
            return owner
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{model}", response_model=ModelCard, responses=_BY_ID)
    def retrieve_model(self, request: Request, model: str) -> Any:
        owner = self._owner(request)
        if isinstance(owner, JSONResponse):
            return owner
        if model != self.svc.model_name:
            return _error(404, f"no model {model!r}; this service runs {self.svc.model_name!r}", "model",
                          code="model_not_found")
        return self._model_card()

    def _model_card(self) -> dict[str, Any]:
        return model_card(self.svc.model_name, self.svc.adapter.card(), self.svc.started_at)

    @app.get("/v1/waves", responses=_AUTH)
    def waves(self, request: Request) -> Any:
        """Recent assignments (ids, rank, latency): for operators and tests."""
        owner = self._owner(request)
        if isinstance(owner, JSONResponse):
            return owner
        return self.svc.waves(owner)

    async def drain(self, timeout_s: float) -> dict[str, Any]:
        """Called by the launcher on SIGTERM before the app is deleted (not a route)."""
        return await asyncio.to_thread(self.svc.drain, timeout_s)

    @app.get("/healthz")
    def healthz(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", responses={503: {"description": "starting, rebuilding, broken or draining"}})
    def readyz(self) -> JSONResponse:
        """200 when a rank group serves; 503 while starting, rebuilding or draining (says which)."""
        r = self.svc.readiness()
        return JSONResponse(r, status_code=200 if r["ready"] else 503)

    def __del__(self) -> None:
        svc = getattr(self, "svc", None)
        if svc is not None:
            svc.close()


def build_app(args: dict[str, Any]) -> Any:
    """Serve application builder: placement-group bundles come from the config."""
    cfg = ServiceConfig(**args)
    bundles = cfg.engine_spec("-").bundles()
    return VideoIngress.options(
        num_replicas=cfg.num_replicas,
        placement_group_bundles=bundles,
        placement_group_strategy=cfg.strategy,
    ).bind(cfg.model_dump())


def deploy(cfg: ServiceConfig, host: str, port: int, name: str = "dloserve",
           blocking: bool = False, proxy_location: str = "EveryNode") -> DeploymentHandle:
    """Start Serve's HTTP proxy on host:port and run the app (used by the CLI and tests)."""
    serve.start(http_options={"host": host, "port": port}, proxy_location=proxy_location)
    return serve.run(build_app(cfg.model_dump()), name=name, route_prefix="/",
                     blocking=blocking)
