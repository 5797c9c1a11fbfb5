"""The service's own state: /healthz (the process answers), /readyz (a rank group serves),
/v1/waves (recent assignments). What each caller may read of it: views.py."""

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from service.api.routes.common import AUTH, owner, service, uploads

# No ``from __future__ import annotations``: FastAPI reads the routes' real types.
router = APIRouter()
NOT_READY = {503: {"description": "starting, rebuilding, broken or draining"}}


@router.get("/v1/waves", responses={401: AUTH[401]})
def waves(request: Request) -> Any:
    """Recent assignments (ids, rank, latency): the caller's own, or every key's for an
    admin key."""
    svc = service(request)
    caller = svc.caller(request.headers.get("authorization"))
    if not (caller.user or caller.admin):
        owner(request)  # the 401, with its reason
    return svc.waves(caller)


@router.get("/healthz")
@router.head("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", responses=NOT_READY)
@router.head("/readyz", responses=NOT_READY)
def readyz(request: Request) -> JSONResponse:
    """200 when a rank group serves; 503 while starting, rebuilding or draining. Without
    a key (when keys are configured) only ``ready`` and ``instance``; an API key adds
    the engine's state and the caller's own counts; an admin key everything."""
    svc = service(request)
    caller = svc.caller(request.headers.get("authorization"))
    r = svc.readiness_for(caller)
    if caller.admin:
        r["uploads"] = uploads(request).count  # request bodies being read now
    return JSONResponse(r, status_code=200 if r["ready"] else 503)
