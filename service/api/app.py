"""FastAPI routes behind a Ray Serve ingress; one replica owns one engine (its rank groups).

No ``from __future__ import annotations`` here: Serve re-wraps the route methods and
FastAPI must see real types, not strings.

``build_app`` is also the Serve application builder for ``serve deploy`` config files
(``import_path: service.api.app:build_app``). The replica itself asks for no CPU and
rides in bundle 0 of the placement group Serve reserves for it from
``placement_group_bundles``; the N worker actors take the N bundles.

Every /v1 route asks ``_owner`` first (API keys, when configured), and so does a query
string FastAPI cannot read (``_bad_params``): a caller without a key learns nothing, not
even which parameter was wrong. /healthz, /readyz and /openapi.json stay open; /readyz
tells an anonymous caller ready or not only (views.py). Bodies are read against
``max_body_bytes`` and ``body_timeout_s`` (http.py). Every answer carries
``X-Content-Type-Options: nosniff`` and a Cache-Control (``no-store`` unless the route
says otherwise: an MP4 is ``private``).
"""

import asyncio
import json
import logging
import time
from dataclasses import replace
from typing import Any, Literal

import ray
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api.adapter_io import AdapterIOBusy, AdapterIOTimeout
from service.api.catalog import ModelCard, ModelList, model_card
from service.api.http import (
    NO_STORE,
    NOSNIFF,
    BodyTimeout,
    TooLarge,
    TooManyUploads,
    Uploads,
    allowed_methods,
    error,
    failed_job,
    read_capped,
    video_response,
)
from service.api.images import ImageTooLarge, body_cap, create_body
from service.api.keys import AuthError
from service.api.openapi import body_rules, instance_openapi
from service.api.origin import LOOPBACK_HOSTS, refusal
from service.api.previews import RESPONSES as PREVIEW_RESPONSES
from service.api.previews import preview_response
from service.api.records import JobRecord, JobStatus
from service.api.results import StorageError
from service.api.schemas import (
    BodyError,
    ErrorResponse,
    LoraCreate,
    MediaTypeError,
    Video,
    VideoCreate,
    VideoDeleted,
    VideoList,
    media_type,
    parse_body,
)
from service.api.service import ServiceConfig, VideoService, video_object
from service.api.startup import Launched
from service.api.storage_health import RETRY_AFTER_S as STORAGE_RETRY_S
from service.api.storage_health import cause_of
from service.api.ui import HEADERS as PAGE_HEADERS
from service.api.ui import register as register_ui
from service.engine.metrics import metrics
from service.router.health import Unavailable
from service.router.queue import QueueFull
from service.router.tenants import QuotaExceeded

log = logging.getLogger("dloserve.api")
# No /docs or /redoc: they load scripts from a CDN on the origin where /ui keeps the key
# (the page at /ui and /openapi.json describe the API instead).
app = FastAPI(title="dloserve", version="0.1.0", description="DiT video generation with DLO",
              docs_url=None, redoc_url=None)

def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic schema with its ``$defs`` put in place (an OpenAPI document has no root $defs)."""
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return walk(dict(defs[ref.rsplit("/", 1)[1]]))
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(schema)


_CREATE_BODY = create_body(_inlined(VideoCreate.model_json_schema()))  # input_reference: a string, or a file
_ERR = {"model": ErrorResponse}
_AUTH = {401: {**_ERR, "description": "missing or unknown API key"},
         422: {**_ERR, "description": "a query parameter is invalid (param names it)"}}
_CREATE_ERRORS = {**_AUTH, 408: {**_ERR, "description": "the body did not start within first_byte_"
                                                         "timeout_s or arrive within body_timeout_s"},
                  413: {**_ERR, "description": "body (or its image) over the size limit"},
                  415: {**_ERR, "description": "not JSON or a form"},
                  422: {**_ERR, "description": "a field is invalid (param names it)"},
                  429: {**_ERR, "description": "this API key's queue is full (quota_exceeded), the "
                                               "whole queue is (queue_full), or this key or address "
                                               "sends too many bodies at once (too_many_uploads); "
                                               "see Retry-After"},
                  503: {**_ERR, "description": "draining, or no rank group can serve; see Retry-After"},
                  507: {**_ERR, "description": "the results storage refuses writes (full); see Retry-After"}}
_BY_ID = {**_AUTH, 404: {**_ERR, "description": "no such video (or another key's)"}}
_MP4 = {200: {"content": {"video/mp4": {}}, "description": "the MP4 (ETag; ranges on local storage)"},
        206: {"content": {"video/mp4": {}}, "description": "the requested range"},
        304: {"description": "not modified (If-None-Match had the current ETag)"},
        400: {**_ERR, "description": "a malformed Range header"},
        416: {**_ERR, "description": "a Range outside the video"}}


def _unauthorized(e: AuthError) -> JSONResponse:
    return error(401, str(e), None, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _too_many(e: TooManyUploads) -> JSONResponse:
    """429 at once, the body unread (the connection closes rather than read it)."""
    return error(429, str(e), None, kind="rate_limit_error", code="too_many_uploads",
                 headers={"Retry-After": "1", "Connection": "close"})


def _address(request: Request) -> str | None:
    """The client's address as the proxy saw it (behind another proxy: that proxy's)."""
    return request.client.host if request.client else None


register_ui(app)  # the playground at /ui/ (service/api/ui)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (404 route, 405 method) in the OpenAI shape; a 405 lists every
    method the path has (Starlette names only those of the first route that matched)."""
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        headers["Allow"] = allowed_methods(request.app.router.routes, request.scope)
    return error(exc.status_code, str(exc.detail), None, code=f"http_{exc.status_code}", headers=headers)


@app.exception_handler(RequestValidationError)
async def _bad_params(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A query or path parameter FastAPI could not read: the key is checked first (401),
    then a 422 in the API's error shape naming the parameter."""
    svc = getattr(request.app.state, "svc", None)
    if svc is not None:
        try:
            svc.owner_of(request.headers.get("authorization"))
        except AuthError as e:
            return _unauthorized(e)
    errors = exc.errors()
    loc = [str(x) for x in (errors[0].get("loc", ()) if errors else ())]
    where, param = (loc[0], loc[-1]) if len(loc) > 1 else ("query", None)
    msg = errors[0].get("msg", "invalid parameter") if errors else "invalid parameter"
    code = errors[0].get("type") if errors else None
    return error(422, f"{param}: {msg}" if param else msg, param, code=code, where=where)


@app.middleware("http")
async def _origin(request: Request, call_next: Any) -> Response:
    """Host and Origin checks (origin.py) before any route: 403 in the API's error shape."""
    svc = getattr(request.app.state, "svc", None)
    hosts = svc.cfg.allowed_hosts if svc is not None else []
    refused = refusal(request.method, request.headers, hosts)
    if refused is not None:
        param = "host" if refused[0] == "forbidden_host" else "origin"
        return error(403, refused[1], param, kind="permission_error", code=refused[0], where="header")
    return await call_next(request)


@app.middleware("http")
async def _headers(request: Request, call_next: Any) -> Response:
    """Every answer names the DP group (replica) that gave it: which replica served a read
    is visible to operators and to the multi-node tests. (The replica's id is its DP group's
    id; asked from Serve here because the class's globals travel pickled by value.) And
    every answer is nosniff, and not cached unless the route said how."""
    response = await call_next(request)
    try:
        response.headers["x-dloserve-dp-group"] = serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a replica (plain FastAPI test client)
        pass
    for name, value in NOSNIFF.items():
        response.headers.setdefault(name, value)
    if response.headers.get("content-type", "").startswith("text/html"):
        for name, value in PAGE_HEADERS.items():  # any HTML answer: the /ui page's CSP and all
            response.headers.setdefault(name, value)
    response.headers.setdefault("Cache-Control", NO_STORE)
    return response


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256,
                  health_check_period_s=5, health_check_timeout_s=30)
@serve.ingress(app)
class VideoIngress:
    def __init__(self, config: dict[str, Any], launched: Launched | None = None) -> None:
        from service.engine.metrics import log_to_stderr

        log_to_stderr()
        self.svc = VideoService(
            ServiceConfig(**config), placement_group=ray.util.get_current_placement_group(),
            dp_group=serve.get_replica_context().replica_id.unique_id, launched=launched,
        )
        if not self.svc.cfg.api_key_hashes:
            log.warning("no API key configured: every client can read and delete every job made "
                        "without a key")
        rules = body_rules(self.svc.adapter, self.svc.limits, self.svc.model_name)
        app.openapi_schema = None
        required = ("input_reference",) if self.svc.adapter.image_input == "required" else ()
        app.openapi_schema = instance_openapi(app.openapi(), rules, required)
        app.state.svc = self.svc  # for _bad_params: the key is checked before a parameter is
        cfg = self.svc.cfg
        self.uploads = Uploads(cfg.max_uploads_per_key, cfg.max_uploads_per_address, cfg.max_uploads)

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine cannot serve is reported unhealthy."""
        problem = self.svc.health_problem()
        if problem:
            raise RuntimeError(problem)

    def _owner(self, request: Request) -> str | None | JSONResponse:
        try:
            return self.svc.owner_of(request.headers.get("authorization"))
        except AuthError as e:
            return _unauthorized(e)

    def _admin(self, request: Request) -> bool:
        """Whether the caller may see what concerns the cluster (a video's ``node_id``)."""
        return self.svc.caller(request.headers.get("authorization")).admin

    async def _create(self, request: Request) -> JobRecord | JSONResponse:
        """The job record as accepted, or the 401/408/413/415/422/429/503 answer."""
        owner = self._owner(request)
        if isinstance(owner, JSONResponse):
            return owner
        draining = self.svc.draining()
        if draining:
            return error(503, draining, None, kind="server_error", code="draining",
                         headers={"Retry-After": "30"})
        ctype = request.headers.get("content-type", "")
        cfg = self.svc.cfg
        try:
            strict = media_type(ctype) == "application/json"  # a form's numbers are strings
            cap = body_cap(media_type(ctype), cfg.max_body_bytes, cfg.max_image_bytes,
                           self.svc.adapter.image_input != "none")
            with self.uploads.slot(owner, _address(request)):
                raw = await read_capped(request, cap, cfg.body_timeout_s, cfg.first_byte_timeout_s)
            fields = await parse_body(ctype, raw)
            # create() writes the job record under a lock the dispatcher shares: keep it
            # off the event loop so status polls are not held up behind it.
            return await asyncio.to_thread(self.svc.create, fields, owner, strict)
        except MediaTypeError as e:
            return error(415, str(e), None, code="unsupported_media_type")
        except TooManyUploads as e:
            metrics()["requests"].inc(1, tags={"status": "over_quota"})
            return _too_many(e)
        except TooLarge as e:
            metrics()["requests"].inc(1, tags={"status": "rejected"})
            return error(413, str(e), None, code="body_too_large")
        except ImageTooLarge as e:
            metrics()["requests"].inc(1, tags={"status": "rejected"})
            return error(413, e.message, e.field, code=e.kind)
        except BodyTimeout as e:
            metrics()["requests"].inc(1, tags={"status": "rejected"})
            return error(408, str(e), None, code="body_timeout", headers={"Connection": "close"})
        except BodyError as e:
            metrics()["requests"].inc(1, tags={"status": "rejected"})
            return error(422, e.message, e.field, code=e.kind)
        except QuotaExceeded as e:  # the caller's own limit, not capacity: not what the alert counts
            metrics()["requests"].inc(1, tags={"status": "over_quota"})
            return error(429, str(e), kind="rate_limit_error", code="quota_exceeded",
                         headers={"Retry-After": str(e.retry_after_s)})
        except QueueFull as e:
            metrics()["requests"].inc(1, tags={"status": "throttled"})
            return error(429, str(e), kind="rate_limit_error", code="queue_full",
                         headers={"Retry-After": str(e.retry_after_s)})
        except StorageError as e:  # (a job-store actor's arrives wrapped: its cause says why)
            metrics()["requests"].inc(1, tags={"status": "refused_storage"})
            return error(507, str(cause_of(e)), None, kind="server_error", code="storage_full",
                         headers={"Retry-After": str(STORAGE_RETRY_S)})
        except Unavailable as e:
            metrics()["requests"].inc(1, tags={"status": "refused_down"})
            return error(503, str(e), kind="server_error", code="engine_down",
                         headers={"Retry-After": str(e.retry_after_s)})

    @app.post("/v1/videos", status_code=202, openapi_extra=_CREATE_BODY, response_model=Video,
              responses=_CREATE_ERRORS)
    async def create_video(self, request: Request) -> JSONResponse:
        """Queue a generation job (JSON or multipart, as the openai client sends)."""
        rec = await self._create(request)
        if isinstance(rec, JSONResponse):
            return rec
        return JSONResponse(video_object(rec, self._admin(request)), status_code=202)

    @app.post("/v1/videos/sync", openapi_extra=_CREATE_BODY, response_class=Response,
              responses={200: _MP4[200], **_CREATE_ERRORS, 500: {**_ERR, "description": "generation failed"}})
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
                return error(404, f"video {vid} was deleted before it finished", "video_id",
                             code="not_found")
            if final.final:
                break
            await asyncio.sleep(0.1)
        headers = {"x-video-id": vid}
        if final.status is not JobStatus.COMPLETED:
            return failed_job(final.error, headers, STORAGE_RETRY_S)
        gone = f"video {vid} has no content (expired or deleted)"
        # S3: network calls, off the event loop
        video = await asyncio.to_thread(video_response, self.svc.storage, vid, request, headers)
        return video or error(404, gone, "video_id", code="not_found", headers=headers)

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
        admin = self._admin(request)
        data = [video_object(r, admin) for r in recs]
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
            return error(404, f"no video {video_id!r}", "video_id", code="not_found")
        headers = {"openai-poll-after-ms": "250"} if not rec.final else {}
        return JSONResponse(video_object(rec, self._admin(request)), headers=headers)

    @app.get("/v1/videos/{video_id}/content", response_class=Response,
             responses={**_MP4, **_BY_ID, 409: {**_ERR, "description": "not completed"}})
    @app.head("/v1/videos/{video_id}/content", response_class=Response,
              responses={**_MP4, **_BY_ID, 409: {**_ERR, "description": "not completed"}})
    def video_content(self, request: Request, video_id: str, variant: Literal["video"] = "video") -> Any:
        owner = self._owner(request)
        if isinstance(owner, JSONResponse):
            return owner
        rec = self.svc.get(video_id, owner)
        if rec is None:
            return error(404, f"no video {video_id!r}", "video_id", code="not_found")
        if rec.status is not JobStatus.COMPLETED:
            return error(409, f"video {video_id} is {rec.status.value}", "video_id", code="not_ready")
        return video_response(self.svc.storage, video_id, request) or error(
            404, f"video {video_id} has no content (expired or deleted)", "video_id", code="not_found")

    @app.get("/v1/videos/{video_id}/preview", response_class=Response,
             responses={**PREVIEW_RESPONSES, **_BY_ID})
    def video_preview(self, request: Request, video_id: str) -> Any:
        """The running job's latest preview image (a latent projection, once per step at most)."""
        owner = self._owner(request)
        if isinstance(owner, JSONResponse):
            return owner
        return preview_response(self.svc, video_id, owner, request)

    @app.delete("/v1/videos/{video_id}", response_model=VideoDeleted, responses=_BY_ID)
    def delete_video(self, request: Request, video_id: str) -> Any:
        """Delete a job; one that is running is cancelled instead (``deleted`` false): it stops
        at its next transformer forward and ends ``cancelled``."""
        owner = self._owner(request)
        if isinstance(owner, JSONResponse):
            return owner
        result = self.svc.delete(video_id, owner)
        if result == "missing":
            return error(404, f"no video {video_id!r}", "video_id", code="not_found")
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
            return error(404, f"no model {model!r}; this service runs {self.svc.model_name!r}", "model",
                         code="model_not_found")
        return self._model_card()

    def _model_card(self) -> dict[str, Any]:
        return model_card(self.svc.model_name, self.svc.adapter.card(), self.svc.started_at)

    # -- adapters ------------------------------------------------------------------------

    @app.post("/v1/loras", status_code=201, openapi_extra={"requestBody": {"required": True, "content": {
              "application/json": {"schema": _inlined(LoraCreate.model_json_schema())}}}},
              responses={**_AUTH, 403: {**_ERR, "description": "source outside the --lora-dir folders"},
                         415: {**_ERR, "description": "not application/json"},
                         409: {**_ERR, "description": "the name is taken (the caller's or the server's), "
                                                      "or the caller has max_loras_per_key adapters"},
                         422: {**_ERR, "description": "a bad adapter (param names the key; source: not a "
                                                      "regular file)"},
                         503: {**_ERR, "description": "every adapter-reading thread is busy (Retry-After)"},
                         504: {**_ERR, "description": "reading the file took over lora_read_timeout_s"}})
    async def create_lora(self, request: Request) -> Any:
        """Register an adapter file under a name; the whole file is checked against the model
        (shapes, keys, layout) before it is accepted."""
        owner = self._owner(request)
        if isinstance(owner, JSONResponse):
            return owner
        from pydantic import ValidationError

        from service.models.lora import LoraError
        from service.models.lora_registry import LoraLimit

        ctype = request.headers.get("content-type") or "application/json"  # none: JSON, as before
        if ctype.split(";")[0].strip().lower() != "application/json":
            return error(415, "POST /v1/loras takes application/json", None, code="unsupported_media_type")
        try:
            cfg = self.svc.cfg
            with self.uploads.slot(owner, _address(request)):
                raw = await read_capped(request, cfg.max_body_bytes, cfg.body_timeout_s,
                                        cfg.first_byte_timeout_s)
            body = LoraCreate.model_validate(json.loads(raw or b"null"))
            # Its own bounded pool with a timeout: a hung read never holds up POST /v1/videos.
            entry = await self.svc.adapter_io.run(self.svc.add_lora, body.name, body.source, owner,
                                                  undo=lambda e: self.svc.delete_lora(e.name, owner))
        except TooManyUploads as e:
            return _too_many(e)
        except TooLarge as e:
            return error(413, str(e), None, code="body_too_large")
        except BodyTimeout as e:
            return error(408, str(e), None, code="body_timeout", headers={"Connection": "close"})
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(422, f"body is not JSON: {e}", "body", code="invalid_json")
        except ValidationError as e:
            err = e.errors()[0]
            return error(422, err["msg"], ".".join(str(x) for x in err["loc"]) or "body", code=err["type"])
        except PermissionError as e:
            return error(403, str(e), "source", code="forbidden_source")
        except KeyError as e:
            return error(409, str(e.args[0]), "name", code="lora_exists")
        except LoraLimit as e:
            return error(409, str(e), "name", code="too_many_loras")
        except LoraError as e:
            return error(422, str(e), e.key, code="invalid_lora")
        except AdapterIOBusy as e:
            return error(503, str(e), "source", kind="server_error", code="lora_io_busy",
                         headers={"Retry-After": str(e.retry_after_s)})
        except AdapterIOTimeout as e:
            return error(504, str(e), "source", kind="server_error", code="lora_read_timeout")
        return JSONResponse(entry.public(), status_code=201)

    @app.get("/v1/loras", responses=_AUTH)
    def list_loras(
        self,
        request: Request,
        after: str | None = Query(None, max_length=64),
        limit: int = Query(20, ge=1, le=100),
        order: Literal["asc", "desc"] = "asc",
    ) -> Any:
        """The registered adapters this caller may use (the server's and its own), oldest
        first, a page at a time as GET /v1/videos pages."""
        owner = self._owner(request)
        if isinstance(owner, JSONResponse):
            return owner
        entries, more = self.svc.loras.page(owner, after, limit, order)
        data = [e.public() for e in entries]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    @app.delete("/v1/loras/{name}", responses={**_AUTH, 404: {**_ERR, "description": "no such adapter"}})
    def delete_lora(self, request: Request, name: str) -> Any:
        """Unregister an adapter: new requests can no longer name it; requests already
        accepted with it run on unchanged (they carry the file's path and digest)."""
        owner = self._owner(request)
        if isinstance(owner, JSONResponse):
            return owner
        if not self.svc.delete_lora(name, owner):
            return error(404, f"no adapter {name!r}", "name", code="not_found")
        return {"id": name, "object": "lora.deleted", "deleted": True}

    @app.get("/v1/waves", responses={401: _AUTH[401]})
    def waves(self, request: Request) -> Any:
        """Recent assignments (ids, rank, latency): the caller's own, or every key's for an
        admin key."""
        caller = self.svc.caller(request.headers.get("authorization"))
        if not (caller.user or caller.admin):
            owner = self._owner(request)  # the 401, with its reason
            assert isinstance(owner, JSONResponse)
            return owner
        return self.svc.waves(caller)

    async def drain(self, timeout_s: float) -> dict[str, Any]:
        """Called by the launcher on SIGTERM before the app is deleted (not a route)."""
        return await asyncio.to_thread(self.svc.drain, timeout_s)

    @app.get("/healthz")
    @app.head("/healthz")
    def healthz(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", responses={503: {"description": "starting, rebuilding, broken or draining"}})
    @app.head("/readyz", responses={503: {"description": "starting, rebuilding, broken or draining"}})
    def readyz(self, request: Request) -> JSONResponse:
        """200 when a rank group serves; 503 while starting, rebuilding or draining. Without
        a key (when keys are configured) only ``ready`` and ``instance``; an API key adds
        the engine's state and the caller's own counts; an admin key everything."""
        caller = self.svc.caller(request.headers.get("authorization"))
        r = self.svc.readiness_for(caller)
        if caller.admin:
            r["uploads"] = self.uploads.count  # request bodies being read now
        return JSONResponse(r, status_code=200 if r["ready"] else 503)

    def __del__(self) -> None:
        svc = getattr(self, "svc", None)
        if svc is not None:
            svc.close()


def build_app(args: dict[str, Any], launched: Launched | None = None) -> Any:
    """Serve application builder: placement-group bundles come from the config; ``launched``:
    what ``dloserve serve`` did before (none from a Serve config file)."""
    cfg = ServiceConfig(**args)
    bundles = cfg.engine_config().parallel.bundles()
    return VideoIngress.options(
        num_replicas=cfg.num_replicas,
        placement_group_bundles=bundles,
        placement_group_strategy=cfg.placement_strategy,
    ).bind(cfg.model_dump(), launched)


def deploy(cfg: ServiceConfig, host: str, port: int, name: str = "dloserve",
           proxy_location: str = "EveryNode", launched: Launched | None = None) -> DeploymentHandle:
    """Start Serve on host:port and run the app (used by the CLI and tests)."""
    if host in LOOPBACK_HOSTS and not cfg.allowed_hosts:  # a loopback bind: loopback names only
        cfg = cfg.model_copy(update={"allowed_hosts": list(LOOPBACK_HOSTS)})
    serve.start(http_options={"host": host, "port": port}, proxy_location=proxy_location)
    if launched and launched.marks:  # /readyz's startup: Serve's controller is up
        launched = replace(launched, marks={**launched.marks, "serve_up": time.time()})
    handle = serve.run(build_app(cfg.model_dump(), launched), name=name, route_prefix="/")
    return handle
