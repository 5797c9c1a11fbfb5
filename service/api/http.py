"""HTTP details every route shares: the error shape, bounded body reads, which methods a
path allows, and how an MP4 is answered (ETag and 304, ranges, caching).

Kept out of app.py so the routes stay a list of routes; nothing here knows the service.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.responses import MalformedRangeHeader, RangeNotSatisfiable
from starlette.routing import Match

from service.api.errors import Answer, ApiError
from service.api.results import ResultStorage

NOSNIFF = {"X-Content-Type-Options": "nosniff"}
NO_STORE = "no-store"  # job status, lists, health: always asked again
OWNED = "private, no-cache"  # an MP4: the owner's browser may keep it, and asks (304) before using it


def error(status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
          code: str | None = None, headers: dict[str, str] | None = None,
          where: str = "body") -> JSONResponse:
    """OpenAI-style error body, plus FastAPI's ``detail`` list so both kinds of client read it."""
    body: dict[str, Any] = {"error": {"message": message, "type": type, "param": param, "code": code}}
    if param is not None:
        body["detail"] = [{"loc": [where, param], "msg": message, "type": code or type}]
    return JSONResponse(body, status_code=status, headers=headers)


def failed_job(err: dict[str, Any] | None, headers: dict[str, str], retry_after_s: int) -> JSONResponse:
    """A job that ended failed, answered whole (``/v1/videos/sync``): 507 with Retry-After where
    its result could not be stored (a full or refusing results storage, as a create refused
    for it is), 500 with the reason otherwise; the API's error shape either way."""
    err = err or {}
    code = err.get("code", "generation_failed")
    message = err.get("message", "generation failed")
    if code == "storage_failed":
        return error(507, message, None, type="server_error", code=code,
                     headers={**headers, "Retry-After": str(retry_after_s)})
    return error(500, message, None, type="server_error", code=code, headers=headers)


class TooLarge(ApiError):
    """The body is over the limit."""

    answer = Answer(413, "body_too_large", metric="rejected")


class BodyTimeout(ApiError):
    """The body did not arrive in time: a slow client holds a replica slot no longer (the
    connection closes rather than wait for the rest)."""

    answer = Answer(408, "body_timeout", metric="rejected", headers=(("Connection", "close"),))


async def read_capped(request: Request, cap: int, timeout_s: float,
                      first_byte_s: float | None = None) -> bytes:
    """The body, never reading more than ``cap`` + one chunk of it, nor for longer than
    ``timeout_s`` in all (a client sending a byte now and then is cut off, not waited for),
    and its first bytes within ``first_byte_s`` (a client that sends headers only is cut off
    sooner still).

    The limit is on the whole body, not between chunks: Serve's proxy passes chunks on as
    they come, so this is where a slow body is seen.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise TooLarge(f"body of {declared} bytes is over the limit of {cap}")
    first_s = first_byte_s if first_byte_s is not None and first_byte_s < timeout_s else None

    async def read() -> bytes:
        chunks, size = [], 0
        stream = request.stream().__aiter__()
        while True:
            try:
                if first_s is not None and not chunks:
                    chunk = await asyncio.wait_for(stream.__anext__(), first_s)
                else:
                    chunk = await stream.__anext__()
            except StopAsyncIteration:
                return b"".join(chunks)
            except TimeoutError:
                raise BodyTimeout(f"the request body did not start within {first_s:g} s") from None
            size += len(chunk)
            if size > cap:
                raise TooLarge(f"body is over the limit of {cap} bytes")
            chunks.append(chunk)

    try:
        return await asyncio.wait_for(read(), timeout_s)
    except TimeoutError:
        raise BodyTimeout(f"the request body did not arrive within {timeout_s:g} s") from None


class TooManyUploads(ApiError):
    """This key or address already sends as many bodies as it may: 429 at once, the body
    unread (the connection closes rather than read it)."""

    answer = Answer(429, "too_many_uploads", type="rate_limit_error", metric="over_quota",
                    headers=(("Retry-After", "1"), ("Connection", "close")))


class Uploads:
    """Request bodies being read at once, per API key, per client address and in all.

    A body that arrives slowly holds one of the replica's request slots (Serve's
    ``max_ongoing_requests``) until it is complete or cut off: one key or address may hold
    only a few, and all bodies together fewer than the slots, so /healthz, /readyz and
    reads always find one free. The event loop is the only caller: no lock.
    """

    def __init__(self, per_key: int | None, per_address: int | None, total: int) -> None:
        self.limits = {"key": per_key, "address": per_address}
        self.total = total
        self.held: Counter[tuple[str, str]] = Counter()
        self.count = 0

    @contextmanager
    def slot(self, key: str | None, address: str | None) -> Iterator[None]:
        """Held while one body is read; TooManyUploads when a cap is reached."""
        mine = [(kind, who) for kind, who in (("key", key), ("address", address))
                if who is not None and self.limits[kind] is not None]
        for kind, who in mine:
            if self.held[(kind, who)] >= (self.limits[kind] or 0):
                name = "API key" if kind == "key" else "client address"
                raise TooManyUploads(f"this {name} is already sending {self.limits[kind]} request bodies; "
                                     "send the next when one of them is answered")
        if self.count >= self.total:
            raise TooManyUploads(f"the service is already reading {self.total} request bodies; retry shortly")
        for h in mine:
            self.held[h] += 1
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1
            for h in mine:
                self.held[h] -= 1
                if not self.held[h]:
                    del self.held[h]


def allowed_methods(routes: list[Any], scope: dict[str, Any]) -> str:
    """Every method the request's path has, for a 405's Allow (Starlette's routes do the
    matching, root_path and all; a method mismatch is a partial match). A path that is a
    route of its own (``/v1/videos/sync``) has that route's methods, not also those of a
    template it happens to fit (``/v1/videos/{video_id}``), as OpenAPI reads paths."""
    matched = [r for r in _flat(routes)
               if getattr(r, "methods", None) and r.matches(scope)[0] is not Match.NONE]
    exact = [r for r in matched if not getattr(r, "param_convertors", None)]
    return ", ".join(sorted({m for r in (exact or matched) for m in r.methods}))


def _flat(routes: list[Any]) -> Iterator[Any]:
    """Routes, with included routers opened (Serve's ingress includes the class's routes as
    a router: FastAPI keeps them behind one ``_IncludedRouter``)."""
    for route in routes:
        inner = getattr(route, "effective_candidates", None)
        if callable(inner):
            yield from _flat(inner())
        else:
            yield route


def etag_matches(header: str | None, etag: str) -> bool:
    """If-None-Match against our ETag (weak comparison, as RFC 9110 asks for GET)."""
    if not header:
        return False
    wanted = etag.removeprefix("W/")
    return any(tag.strip() == "*" or tag.strip().removeprefix("W/") == wanted for tag in header.split(","))


def range_problem(request: Request, size: int, etag: str) -> JSONResponse | None:
    """A Range header Starlette would honour but cannot: 400 (malformed) or 416 (outside
    the file), in the API's error shape rather than Starlette's plain text."""
    value = request.headers.get("range")
    if value is None:
        return None
    if_range = request.headers.get("if-range")
    if if_range is not None and if_range != etag and if_range.startswith(('"', "W/")):
        return None  # another version's validator: the whole file is sent, the range ignored
    try:
        FileResponse._parse_range_header(value, size)
    except MalformedRangeHeader as e:
        return error(400, f"bad Range header {value!r}: {e.content}", "range", code="invalid_range",
                     where="header")
    except RangeNotSatisfiable:
        return error(416, f"Range {value!r} is outside the video's {size} bytes", "range",
                     code="range_not_satisfiable", headers={"Content-Range": f"bytes */{size}"},
                     where="header")
    return None


def video_response(storage: ResultStorage, vid: str, request: Request,
                   headers: dict[str, str] | None = None) -> Response | None:
    """The MP4 from the results storage (whichever replica stored it), None if it is gone.

    The bytes of a video never change, so its ETag is its id and size: If-None-Match with it
    answers 304. A local folder is sent as a file (ranges, sendfile); any other URL is
    streamed whole (a server may ignore Range).
    """
    path = storage.video_path(vid)
    name = f"{vid}.mp4"
    if path is None and (storage.local_path is not None or not storage.has_video(vid)):
        return None
    size = path.stat().st_size if path is not None else storage.size(name)
    etag = f'"{vid}-{size}"'
    head = {**(headers or {}), "ETag": etag, "Cache-Control": OWNED, "Vary": "Authorization"}
    if request.method in ("GET", "HEAD"):  # a POST (the sync route) is answered whole
        if etag_matches(request.headers.get("if-none-match"), etag):
            return Response(status_code=304, headers=head)
        bad = range_problem(request, size, etag)
        if bad is not None:
            return bad
    if path is not None:
        return FileResponse(path, media_type="video/mp4", filename=name, headers=head)
    head = {**head, "content-length": str(size), "content-disposition": f'attachment; filename="{name}"'}
    return StreamingResponse(storage.chunks(name), media_type="video/mp4", headers=head)
