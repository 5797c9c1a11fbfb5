"""``GET /v1/videos/{id}/preview``: the latest preview image of a job, for its owner.

The ranks make the images (engine.preview) and the job store keeps the latest per job in
memory (``JobTable.put_previews``); this answers it with an ETag, 304 to a matching
If-None-Match, and a 404 that says why there is none: no step has run yet, or the job
ended before its first step (a finished job keeps its last step's preview while the job
is kept, unless the job store restarted).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request, Response

from service.api.http import error, etag_matches
from service.models.preview import MEDIA_TYPE

RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {MEDIA_TYPE: {}}, "description": "the latest preview (ETag; at most one per step)"},
    304: {"description": "If-None-Match matched: no newer preview"},
}


def preview_response(svc: Any, video_id: str, owner: str | None, request: Request) -> Response:
    """The preview of ``video_id`` as ``owner`` may see it (another key's job: 404, as for the job)."""
    rec = svc.get(video_id, owner)
    if rec is None:
        return error(404, f"no video {video_id!r}", "video_id", code="not_found")
    got = svc.store.preview(video_id)
    if got is None:
        if rec.final:
            why = (f"video {video_id} has no preview: it ended ({rec.status.value}) before its first "
                   "denoising step, or its preview is no longer kept")
        else:
            why = (f"video {video_id} has no preview yet: it is {rec.status.value}; one shows once its "
                   "first denoising step has run")
        return error(404, why, "video_id", code="preview_not_ready")
    step, data, tag = got
    etag = f'"{tag}"'
    headers = {"etag": etag, "cache-control": "private, no-cache", "x-preview-step": str(step)}
    if etag_matches(request.headers.get("if-none-match"), etag):
        return Response(status_code=304, headers=headers)
    return Response(data, media_type=MEDIA_TYPE, headers=headers)
