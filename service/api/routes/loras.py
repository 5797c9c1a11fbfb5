"""/v1/loras: register an adapter file under a name, list them, unregister one.

A registration reads and checks the whole file against the model (shapes, keys, layout) on
its own bounded pool with a timeout (adapter_io.py): a hung read never holds up the videos.
"""

import json
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from service.api.errors import BodyError, NotFound
from service.api.http import read_capped
from service.api.openapi import inlined
from service.api.routes.common import AUTH, ERR, address, owner, page, service, uploads
from service.api.schemas import LoraCreate, MediaTypeError

# No ``from __future__ import annotations``: FastAPI reads the routes' real types.
router = APIRouter()
CREATE_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": inlined(LoraCreate.model_json_schema())}}}}
CREATE_ERRORS = {**AUTH, 403: {**ERR, "description": "source outside the --lora-dir folders"},
                 415: {**ERR, "description": "not application/json"},
                 409: {**ERR, "description": "the name is taken (the caller's or the server's), "
                                             "or the caller has max_loras_per_key adapters"},
                 422: {**ERR, "description": "a bad adapter (param names the key; source: not a "
                                             "regular file)"},
                 503: {**ERR, "description": "every adapter-reading thread is busy (Retry-After)"},
                 504: {**ERR, "description": "reading the file took over lora_read_timeout_s"}}


@router.post("/v1/loras", status_code=201, openapi_extra=CREATE_BODY, responses=CREATE_ERRORS)
async def create_lora(request: Request) -> Any:
    """Register an adapter file under a name; the whole file is checked against the model
    (shapes, keys, layout) before it is accepted."""
    who = owner(request)
    svc = service(request)
    ctype = request.headers.get("content-type") or "application/json"  # none: JSON, as before
    if ctype.split(";")[0].strip().lower() != "application/json":
        raise MediaTypeError("POST /v1/loras takes application/json")
    cfg = svc.cfg
    with uploads(request).slot(who, address(request)):
        raw = await read_capped(request, cfg.max_body_bytes, cfg.body_timeout_s, cfg.first_byte_timeout_s)
    body = _parse(raw)
    entry = await svc.adapter_io.run(svc.add_lora, body.name, body.source, who,
                                     undo=lambda e: svc.delete_lora(e.name, who))
    return JSONResponse(entry.public(), status_code=201)


def _parse(raw: bytes) -> LoraCreate:
    """The body as a ``LoraCreate``; BodyError naming the field (or ``body``) otherwise."""
    try:
        return LoraCreate.model_validate(json.loads(raw or b"null"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BodyError("body", f"body is not JSON: {e}", "invalid_json") from None
    except ValidationError as e:
        err = e.errors()[0]
        raise BodyError(".".join(str(x) for x in err["loc"]) or "body", err["msg"], err["type"]) from None


@router.get("/v1/loras", responses=AUTH)
def list_loras(
    request: Request,
    after: str | None = Query(None, max_length=64),
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = "asc",
) -> Any:
    """The registered adapters this caller may use (the server's and its own), oldest
    first, a page at a time as GET /v1/videos pages."""
    entries, more = service(request).loras.page(owner(request), after, limit, order)
    return {"object": "list", **page([e.public() for e in entries], more)}


@router.delete("/v1/loras/{name}", responses={**AUTH, 404: {**ERR, "description": "no such adapter"}})
def delete_lora(request: Request, name: str) -> Any:
    """Unregister an adapter: new requests can no longer name it; requests already
    accepted with it run on unchanged (they carry the file's path and digest)."""
    if not service(request).delete_lora(name, owner(request)):
        raise NotFound(f"no adapter {name!r}", "name")
    return {"id": name, "object": "lora.deleted", "deleted": True}
