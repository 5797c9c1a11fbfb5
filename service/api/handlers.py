"""The one place errors become responses: the answers of the lower layers' errors, the handler
that answers every error the API knows, and FastAPI's and Starlette's own errors in the same
shape.

Routes raise; they build no error responses (but for a sync create whose job failed, whose
500/507 is the job's outcome, ``http.failed_job``, and the preview's 404s, ``previews.py``,
which answers whole). An ``ApiError`` (errors.py) carries its answer;
the errors of the router and the models (shared with the batch job, which knows no HTTP) and
the results storage's ``StorageError`` (an ``OSError`` that must pickle as one) get theirs in
``ANSWERS``. A create route marks its request (``count_refusals``): a refusal of it is counted
in ``dloserve_requests`` under the answer's ``metric``, as the dashboards' alerts expect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api.errors import Answer, ApiError
from service.api.http import allowed_methods, error
from service.api.keys import AuthError
from service.api.results import StorageError
from service.api.storage_health import RETRY_AFTER_S as STORAGE_RETRY_S
from service.api.storage_health import cause_of
from service.engine.metrics import metrics
from service.models.lora_ref import LoraError
from service.models.lora_registry import LoraLimit
from service.router.health import Unavailable
from service.router.queue import QueueFull
from service.router.tenants import QuotaExceeded

ANSWERS: dict[type[BaseException], Answer] = {
    # the caller's own limit, not capacity: not what the throttling alert counts
    QuotaExceeded: Answer(429, "quota_exceeded", type="rate_limit_error", metric="over_quota"),
    QueueFull: Answer(429, "queue_full", type="rate_limit_error", metric="throttled"),
    Unavailable: Answer(503, "engine_down", type="server_error", metric="refused_down"),
    # (a job-store actor's arrives wrapped in Ray's error: its cause says why)
    StorageError: Answer(507, "storage_full", type="server_error", metric="refused_storage",
                         headers=(("Retry-After", str(STORAGE_RETRY_S)),)),
    LoraLimit: Answer(409, "too_many_loras", param="name"),
    LoraError: Answer(422, "invalid_lora", param_attr="key"),
}
_COUNTED = "dloserve_count_refusals"


def answer_of(exc: BaseException) -> Answer | None:
    """The answer of ``exc``'s class (or of the nearest base that has one); None: a 500."""
    for cls in type(exc).__mro__:
        own = cls.__dict__.get("answer")
        if isinstance(own, Answer):
            return own
        if cls in ANSWERS:
            return ANSWERS[cls]
    return None


@dataclass(frozen=True)
class Answered:
    """One error, answered: what the client reads, and the label a refused create counts as."""

    answer: Answer  # its class's
    message: str
    param: str | None
    code: str
    headers: dict[str, str]


def describe(exc: BaseException) -> Answered | None:
    """``exc`` as the API answers it; None: no answer (a 500)."""
    ans = answer_of(exc)
    if ans is None:
        return None
    headers = dict(ans.headers)
    if isinstance(exc, ApiError):
        message, param, code = exc.message, exc.param, exc.code
        headers.update(exc.headers)
    else:
        param = getattr(exc, ans.param_attr) if ans.param_attr else ans.param
        message, code = str(cause_of(exc)), ans.code
    retry = getattr(exc, "retry_after_s", None)
    if retry is not None:
        headers["Retry-After"] = str(retry)
    return Answered(ans, message, param, code, headers)


def respond(exc: BaseException, request: Request | None = None) -> JSONResponse:
    """``exc`` as the API answers it; a refused create counts under the answer's metric."""
    got = describe(exc)
    if got is None:
        raise exc
    ans = got.answer
    if ans.metric and request is not None and getattr(request.state, _COUNTED, False):
        metrics()["requests"].inc(1, tags={"status": ans.metric})
    return error(ans.status, got.message, got.param, type=ans.type, code=got.code,
                 headers=got.headers or None, where=ans.where)


def count_refusals(request: Request) -> None:
    """From here on, an error that refuses this request is counted (the create routes)."""
    setattr(request.state, _COUNTED, True)


async def _answer(request: Request, exc: Exception) -> JSONResponse:
    return respond(exc, request)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (404 route, 405 method) in the OpenAI shape; a 405 lists every
    method the path has (Starlette names only those of the first route that matched)."""
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        headers["Allow"] = allowed_methods(request.app.router.routes, request.scope)
    return error(exc.status_code, str(exc.detail), None, code=f"http_{exc.status_code}", headers=headers)


async def _bad_params(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A query or path parameter FastAPI could not read: the key is checked first (401),
    then a 422 in the API's error shape naming the parameter."""
    svc = getattr(request.app.state, "svc", None)
    if svc is not None:
        try:
            svc.owner_of(request.headers.get("authorization"))
        except AuthError as e:
            return respond(e, request)
    errors = exc.errors()
    loc = [str(x) for x in (errors[0].get("loc", ()) if errors else ())]
    where, param = (loc[0], loc[-1]) if len(loc) > 1 else ("query", None)
    msg = errors[0].get("msg", "invalid parameter") if errors else "invalid parameter"
    code = errors[0].get("type") if errors else None
    return error(422, f"{param}: {msg}" if param else msg, param, code=code, where=where)


def answered() -> list[type[BaseException]]:
    """Every error class with an answer: ``ApiError`` (its subclasses inherit the handler) and
    the lower layers' in ``ANSWERS``."""
    return [ApiError, *ANSWERS]


def install(app: FastAPI) -> None:
    """The handlers on ``app``: one for every answered error, Starlette's, FastAPI's."""
    handler: Any = _answer
    for cls in answered():
        app.add_exception_handler(cls, handler)
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _bad_params)  # type: ignore[arg-type]
