"""The HTTP helpers on plain FastAPI apps, routed as Serve's ingress routes them (fast)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from service.api.http import allowed_methods, etag_matches


def test_allow_lists_the_methods_of_routes_behind_an_included_router_under_any_root_path() -> None:
    """Serve's ingress includes the class's routes as a router and sets root_path to the
    route prefix ("/" for the main app): both hid every route from the 405 handler."""
    app, router = FastAPI(), APIRouter()
    router.add_api_route("/v1/videos", lambda: 1, methods=["GET"])
    router.add_api_route("/v1/videos", lambda: 1, methods=["POST"])
    router.add_api_route("/v1/videos/sync", lambda: 1, methods=["POST"])
    router.add_api_route("/v1/videos/{video_id}", lambda video_id: 1, methods=["GET", "DELETE"])
    app.include_router(router)
    seen: list[str] = []

    @app.exception_handler(HTTPException)
    async def handler(request: Request, exc: HTTPException) -> JSONResponse:
        seen.append(allowed_methods(request.app.router.routes, request.scope))
        return JSONResponse({}, status_code=exc.status_code)

    async def put(root: str, path: str) -> None:
        scope = {"type": "http", "method": "PUT", "path": path, "root_path": root, "headers": [],
                 "query_string": b"", "http_version": "1.1", "scheme": "http", "server": ("x", 80)}

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            pass

        await app(scope, receive, send)

    for root, path in (("", "/v1/videos"), ("/", "/v1/videos"), ("/keyed", "/keyed/v1/videos"),
                       ("/", "/v1/videos/sync"), ("/", "/v1/videos/abc")):
        asyncio.run(put(root, path))
    # a path that is a route of its own is not also the template it fits (OpenAPI's reading)
    assert seen == ["GET, POST"] * 3 + ["POST", "DELETE, GET"]


def test_if_none_match_compares_weakly_and_takes_lists() -> None:
    tag = '"video_1-10"'
    assert etag_matches(tag, tag) and etag_matches(f"W/{tag}", tag) and etag_matches(f'"x", {tag}', tag)
    assert etag_matches("*", tag) and not etag_matches('"video_1-11"', tag) and not etag_matches(None, tag)


def test_a_sync_job_whose_result_could_not_be_stored_is_a_507_in_the_error_shape() -> None:
    import json

    from service.api.http import failed_job

    err = {"code": "storage_failed", "message": "the result could not be stored; submit it again"}
    full = failed_job(err, {"x-video-id": "video_1"}, 5)
    assert full.status_code == 507 and full.headers["retry-after"] == "5"
    assert full.headers["x-video-id"] == "video_1"
    assert json.loads(full.body)["error"] == {"message": "the result could not be stored; submit it again",
                                              "type": "server_error", "param": None, "code": "storage_failed"}
    other = failed_job({"code": "rank_failed", "message": "boom"}, {}, 5)
    assert other.status_code == 500 and "retry-after" not in other.headers
    assert json.loads(failed_job(None, {}, 5).body)["error"]["code"] == "generation_failed"
