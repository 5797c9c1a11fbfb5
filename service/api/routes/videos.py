"""/v1/videos: create (queued, or answered with the MP4 itself), list, retrieve, content,
preview, delete.

Bodies are read against ``max_body_bytes`` and ``body_timeout_s`` (http.py), a few at a time
per key and address (``Uploads``); an MP4 is ``private`` to its owner's cache (http.py).
Refusals of a create are counted in ``dloserve_requests`` (handlers.count_refusals).
"""

import asyncio
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from service.api.errors import Draining, NotFound, NotReady
from service.api.handlers import count_refusals
from service.api.http import failed_job, read_capped, video_response
from service.api.images import body_cap, create_body
from service.api.openapi import inlined
from service.api.previews import RESPONSES as PREVIEW_RESPONSES
from service.api.previews import preview_response
from service.api.records import JobRecord, JobStatus
from service.api.routes.common import AUTH, BY_ID, ERR, address, is_admin, owner, page, service, uploads
from service.api.schemas import Video, VideoCreate, VideoDeleted, VideoList, media_type, parse_body
from service.api.service import video_object
from service.api.storage_health import RETRY_AFTER_S as STORAGE_RETRY_S

# No ``from __future__ import annotations``: FastAPI reads the routes' real types.
router = APIRouter()
CREATE_BODY = create_body(inlined(VideoCreate.model_json_schema()))  # input_reference: a string, or a file
CREATE_ERRORS = {**AUTH, 408: {**ERR, "description": "the body did not start within first_byte_"
                                                     "timeout_s or arrive within body_timeout_s"},
                 413: {**ERR, "description": "body (or its image) over the size limit"},
                 415: {**ERR, "description": "not JSON or a form"},
                 422: {**ERR, "description": "a field is invalid (param names it)"},
                 429: {**ERR, "description": "this API key's queue is full (quota_exceeded), the "
                                             "whole queue is (queue_full), or this key or address "
                                             "sends too many bodies at once (too_many_uploads); "
                                             "see Retry-After"},
                 503: {**ERR, "description": "draining, or no rank group can serve; see Retry-After"},
                 507: {**ERR, "description": "the results storage refuses writes (full); see Retry-After"}}
MP4 = {200: {"content": {"video/mp4": {}}, "description": "the MP4 (ETag; ranges on local storage)"},
       206: {"content": {"video/mp4": {}}, "description": "the requested range"},
       304: {"description": "not modified (If-None-Match had the current ETag)"},
       400: {**ERR, "description": "a malformed Range header"},
       416: {**ERR, "description": "a Range outside the video"}}
NOT_COMPLETED = {409: {**ERR, "description": "not completed"}}


async def create(request: Request) -> JobRecord:
    """The job record as accepted; raises what refuses it (401/408/413/415/422/429/503/507)."""
    who = owner(request)
    svc = service(request)
    draining = svc.draining()
    if draining:
        raise Draining(draining)
    count_refusals(request)
    ctype = request.headers.get("content-type", "")
    cfg = svc.cfg
    strict = media_type(ctype) == "application/json"  # a form's numbers are strings
    cap = body_cap(media_type(ctype), cfg.max_body_bytes, cfg.max_image_bytes,
                   svc.adapter.image_input != "none")
    with uploads(request).slot(who, address(request)):
        raw = await read_capped(request, cap, cfg.body_timeout_s, cfg.first_byte_timeout_s)
    fields = await parse_body(ctype, raw)
    # create() writes the job record under a lock the dispatcher shares: keep it off the
    # event loop so status polls are not held up behind it.
    return await asyncio.to_thread(svc.create, fields, who, strict)


@router.post("/v1/videos", status_code=202, openapi_extra=CREATE_BODY, response_model=Video,
             responses=CREATE_ERRORS)
async def create_video(request: Request) -> JSONResponse:
    """Queue a generation job (JSON or multipart, as the openai client sends)."""
    rec = await create(request)
    return JSONResponse(video_object(rec, is_admin(request)), status_code=202)


@router.post("/v1/videos/sync", openapi_extra=CREATE_BODY, response_class=Response,
             responses={200: MP4[200], **CREATE_ERRORS, 500: {**ERR, "description": "generation failed"}})
async def create_video_sync(request: Request) -> Response:
    """Generate and answer the MP4 itself; the job is also listed under /v1/videos.

    The job id is in the ``x-video-id`` header. A failed job answers 500 with the reason;
    a client that disconnects does not cancel the job (fetch it by id later).
    """
    rec = await create(request)
    svc = service(request)
    vid, who = rec.id, rec.owner
    while True:
        final = await asyncio.to_thread(svc.get, vid, who)  # a call to the job store
        if final is None:
            raise NotFound(f"video {vid} was deleted before it finished", "video_id")
        if final.final:
            break
        await asyncio.sleep(0.1)
    headers = {"x-video-id": vid}
    if final.status is not JobStatus.COMPLETED:
        return failed_job(final.error, headers, STORAGE_RETRY_S)
    # S3: network calls, off the event loop
    video = await asyncio.to_thread(video_response, svc.storage, vid, request, headers)
    if video is None:
        raise _gone(vid, headers)
    return video


@router.get("/v1/videos", response_model=VideoList, responses=AUTH)
def list_videos(
    request: Request,
    after: str | None = Query(None, max_length=64),
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
) -> Any:
    recs, more = service(request).list(after, limit, order, owner(request))
    admin = is_admin(request)
    data = [video_object(r, admin) for r in recs]
    return VideoList.model_validate(page(data, more))


@router.get("/v1/videos/{video_id}", response_model=Video, responses=BY_ID)
def retrieve_video(request: Request, video_id: str) -> Any:
    rec = _owned(request, video_id)
    headers = {"openai-poll-after-ms": "250"} if not rec.final else {}
    return JSONResponse(video_object(rec, is_admin(request)), headers=headers)


@router.get("/v1/videos/{video_id}/content", response_class=Response,
            responses={**MP4, **BY_ID, **NOT_COMPLETED})
@router.head("/v1/videos/{video_id}/content", response_class=Response,
             responses={**MP4, **BY_ID, **NOT_COMPLETED})
def video_content(request: Request, video_id: str, variant: Literal["video"] = "video") -> Any:
    rec = _owned(request, video_id)
    if rec.status is not JobStatus.COMPLETED:
        raise NotReady(f"video {video_id} is {rec.status.value}")
    video = video_response(service(request).storage, video_id, request)
    if video is None:
        raise _gone(video_id)
    return video


@router.get("/v1/videos/{video_id}/preview", response_class=Response,
            responses={**PREVIEW_RESPONSES, **BY_ID})
def video_preview(request: Request, video_id: str) -> Any:
    """The running job's latest preview image (a latent projection, once per step at most)."""
    return preview_response(service(request), video_id, owner(request), request)


@router.delete("/v1/videos/{video_id}", response_model=VideoDeleted, responses=BY_ID)
def delete_video(request: Request, video_id: str) -> Any:
    """Delete a job; one that is running is cancelled instead (``deleted`` false): it stops
    at its next transformer forward and ends ``cancelled``."""
    result = service(request).delete(video_id, owner(request))
    if result == "missing":
        raise NotFound(f"no video {video_id!r}", "video_id")
    return VideoDeleted(id=video_id, deleted=result == "deleted")


def _owned(request: Request, video_id: str) -> JobRecord:
    """The caller's video; NotFound for none (or another key's)."""
    rec = service(request).get(video_id, owner(request))
    if rec is None:
        raise NotFound(f"no video {video_id!r}", "video_id")
    return rec


def _gone(video_id: str, headers: dict[str, str] | None = None) -> NotFound:
    return NotFound(f"video {video_id} has no content (expired or deleted)", "video_id", headers=headers)
