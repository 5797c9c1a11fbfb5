"""What every route module shares: the caller (its key, its address), the replica's service,
and the error responses the OpenAPI document declares.

Every /v1 route asks ``owner`` first (API keys, when configured): a caller without a key
learns nothing, not even which parameter was wrong (handlers._bad_params checks the key too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import Request

from service.api.http import Uploads
from service.api.schemas import ErrorResponse

if TYPE_CHECKING:
    from service.api.service import VideoService

ERR = {"model": ErrorResponse}
AUTH = {401: {**ERR, "description": "missing or unknown API key"},
        422: {**ERR, "description": "a query parameter is invalid (param names it)"}}
BY_ID = {**AUTH, 404: {**ERR, "description": "no such video (or another key's)"}}


def service(request: Request) -> VideoService:
    """The replica's service (set by ``app.create_app``)."""
    return request.app.state.svc


def uploads(request: Request) -> Uploads:
    """The replica's count of request bodies being read (set by ``app.create_app``)."""
    return request.app.state.uploads


def owner(request: Request) -> str | None:
    """The caller's owner id; AuthError (401) without a key, or with an unknown one, when keys
    are configured."""
    return service(request).owner_of(request.headers.get("authorization"))


def is_admin(request: Request) -> bool:
    """Whether the caller may see what concerns the cluster (a video's ``node_id``)."""
    return service(request).caller(request.headers.get("authorization")).admin


def address(request: Request) -> str | None:
    """The client's address as the proxy saw it (behind another proxy: that proxy's)."""
    return request.client.host if request.client else None


def page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    """A list answer as OpenAI's: the page, its first and last ids, whether more follow."""
    return {"data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}
