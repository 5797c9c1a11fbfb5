"""Every error the API knows goes through the one handler with its status, code, type and metric
label; a new error class, or a route (or what it calls) raising one without an answer, fails
here until it gets one (or a written reason why it never reaches a client).

The answers below are written out again on purpose: they are the API's contract (clients
and the alerts read these codes and labels), so a change to one must be made twice.
"""

from __future__ import annotations

import ast
import builtins
import errno
import importlib
import inspect
import json
import pkgutil
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request

import service.api
from service.api import handlers
from service.api.adapter_io import AdapterIOBusy, AdapterIOTimeout
from service.api.errors import (
    ApiError,
    BodyError,
    Draining,
    ForbiddenSource,
    LoraExists,
    ModelNotFound,
    NotFound,
    NotReady,
)
from service.api.http import BodyTimeout, TooLarge, TooManyUploads
from service.api.images import ImageTooLarge
from service.api.keys import AuthError
from service.api.results import StorageError
from service.api.schemas import MediaTypeError
from service.api.storage_health import RETRY_AFTER_S
from service.models.lora_ref import LoraError
from service.models.lora_registry import LoraLimit
from service.router.health import Unavailable
from service.router.queue import QueueFull
from service.router.tenants import QuotaExceeded

ROOT = Path(service.api.__file__).resolve().parent

# class -> (an instance, status, code, type, param, metric label, headers it must carry)
Case = tuple[BaseException, int, str, str, str | None, str | None, dict[str, str]]
CASES: dict[type[BaseException], Case] = {
    BodyError: (BodyError("width", "must be a multiple of 16", "value_error"), 422, "value_error",
                "invalid_request_error", "width", "rejected", {}),
    ImageTooLarge: (ImageTooLarge("input_reference", "over the limit", "image_too_large"), 413,
                    "image_too_large", "invalid_request_error", "input_reference", "rejected", {}),
    MediaTypeError: (MediaTypeError("unsupported content type 'text/plain'"), 415, "unsupported_media_type",
                     "invalid_request_error", None, None, {}),
    AuthError: (AuthError("Incorrect API key provided"), 401, "invalid_api_key", "invalid_request_error",
                None, None, {"WWW-Authenticate": "Bearer"}),
    TooLarge: (TooLarge("body is over the limit of 10 bytes"), 413, "body_too_large", "invalid_request_error",
               None, "rejected", {}),
    BodyTimeout: (BodyTimeout("the request body did not arrive within 10 s"), 408, "body_timeout",
                  "invalid_request_error", None, "rejected", {"Connection": "close"}),
    TooManyUploads: (TooManyUploads("this API key is already sending 8 request bodies"), 429,
                     "too_many_uploads", "rate_limit_error", None, "over_quota",
                     {"Retry-After": "1", "Connection": "close"}),
    Draining: (Draining("service stopped: draining"), 503, "draining", "server_error", None, None,
               {"Retry-After": "30"}),
    NotFound: (NotFound("no video 'v'", "video_id"), 404, "not_found", "invalid_request_error", "video_id",
               None, {}),
    ModelNotFound: (ModelNotFound("no model 'x'"), 404, "model_not_found", "invalid_request_error", "model",
                    None, {}),
    NotReady: (NotReady("video v is queued"), 409, "not_ready", "invalid_request_error", "video_id",
               None, {}),
    ForbiddenSource: (ForbiddenSource("source must be a file under one of this server's --lora-dir folders"),
                      403, "forbidden_source", "invalid_request_error", "source", None, {}),
    LoraExists: (LoraExists("adapter 'a' is already registered"), 409, "lora_exists", "invalid_request_error",
                 "name", None, {}),
    AdapterIOBusy: (AdapterIOBusy("all 4 adapter-reading threads are busy"), 503, "lora_io_busy",
                    "server_error", "source", None, {"Retry-After": "30"}),
    AdapterIOTimeout: (AdapterIOTimeout("reading the adapter took over 30 s"), 504, "lora_read_timeout",
                       "server_error", "source", None, {}),
    QuotaExceeded: (QuotaExceeded(3, 3, 12), 429, "quota_exceeded", "rate_limit_error", None, "over_quota",
                    {"Retry-After": "12"}),
    QueueFull: (QueueFull(64, 5), 429, "queue_full", "rate_limit_error", None, "throttled",
                {"Retry-After": "5"}),
    Unavailable: (Unavailable("no rank group can serve", 20), 503, "engine_down", "server_error", None,
                  "refused_down", {"Retry-After": "20"}),
    StorageError: (StorageError(errno.ENOSPC, "the results storage is full"), 507, "storage_full",
                   "server_error", None, "refused_storage", {"Retry-After": str(RETRY_AFTER_S)}),
    LoraLimit: (LoraLimit("this key has 3 adapters registered"), 409, "too_many_loras",
                "invalid_request_error", "name", None, {}),
    LoraError: (LoraError("a", "file", "not a readable safetensors file"), 422, "invalid_lora",
                "invalid_request_error", "file", None, {}),
}

# The start-up's modules: their errors end a start (exit codes), no route raises them.
START_UP = {"launch", "hostproc", "startup", "serve_flags", "config",
            "metrics_discovery", "watchdog", "cleanup"}
# Errors of the api layer that never reach a client through a route, and why.
NEVER_ANSWERED = {
    "KeyFileError": "a key file the launcher cannot read: `dloserve serve` exits 2 naming the line",
    "WebhookConfigError": "a webhook setting: refused at start-up",
    "UnusableFile": "a file in the results storage no writer of ours left: skipped when the store opens",
    "StoreLocked": "another process holds the job store's folder: the start fails",
    "RefusedAddress": "a webhook target's address: the delivery fails and is logged",
}
# Names raised in the route modules and what they call that a route never sees, and why.
CAUGHT = {
    "RequestError": "VideoService.create turns it into a BodyError naming the field",
    "ValueError": "a pydantic validator's: validate_create turns it into a BodyError",
    "KeyError": "the LoRA registry's: VideoService.add_lora turns it into LoraExists",
}


def request() -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/videos", "headers": [], "state": {}})


def api_errors() -> set[type[BaseException]]:
    """Every error class (an Exception) defined in service.api but its start-up modules."""
    for mod in pkgutil.walk_packages([str(ROOT)], "service.api."):
        importlib.import_module(mod.name)
    found: set[type[BaseException]] = set()
    for name, module in list(importlib.sys.modules.items()):
        if name.startswith("service.api.") and name.rsplit(".", 1)[1] not in START_UP:
            found |= {obj for obj in vars(module).values()
                      if inspect.isclass(obj) and issubclass(obj, Exception)
                      and obj.__module__ == module.__name__}
    return found


@pytest.mark.parametrize("cls", list(CASES), ids=lambda c: c.__name__)
def test_each_error_is_answered_with_its_status_code_type_param_and_metric(cls: type[BaseException]) -> None:
    exc, status, code, kind, param, metric, headers = CASES[cls]
    got = handlers.describe(exc)
    assert got is not None, f"{cls.__name__} has no answer"
    assert (got.answer.status, got.code, got.answer.type, got.param, got.answer.metric) == \
        (status, code, kind, param, metric)
    response = handlers.respond(exc, request())
    body = json.loads(response.body)
    assert response.status_code == status
    assert body["error"] == {"message": got.message, "type": kind, "param": param, "code": code}
    assert ("detail" in body) == (param is not None)  # FastAPI's shape too, where a field is named
    for name, value in headers.items():
        assert response.headers[name] == value, (cls.__name__, name)


def test_an_error_pickled_as_ray_sends_it_is_answered_the_same() -> None:
    import pickle

    for cls, (exc, *_rest) in CASES.items():
        again = pickle.loads(pickle.dumps(exc))
        assert type(again) is cls and handlers.describe(again) == handlers.describe(exc), cls.__name__


def test_every_error_class_of_the_api_layer_has_an_answer_or_a_reason() -> None:
    missing = [c.__qualname__ for c in api_errors()
               if c is not ApiError and handlers.answer_of(c.__new__(c)) is None
               and c.__name__ not in NEVER_ANSWERED]
    assert not missing, f"give these an Answer (errors.py) or a reason in NEVER_ANSWERED: {missing}"
    untested = [c.__name__ for c in api_errors() | set(handlers.ANSWERS)
                if c is not ApiError and c not in CASES and c.__name__ not in NEVER_ANSWERED]
    assert not untested, f"add these to CASES: {untested}"


def raised_names(path: Path) -> set[str]:
    """The names of the classes ``raise X(...)`` / ``raise X`` raises in a file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and node.exc is not None:
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(target, ast.Name) and target.id[:1].isupper():
                out.add(target.id)
    return out


def test_what_a_route_can_raise_has_an_answer() -> None:
    """The route modules and the api modules they call: every class they raise is answered
    (or caught before a client sees it, CAUGHT says where)."""
    files = [*sorted((ROOT / "routes").glob("*.py")),
             *(ROOT / f"{m}.py" for m in ("service", "http", "schemas", "images", "keys", "adapter_io",
                                          "storage_health", "previews"))]
    unanswered = []
    for path in files:
        module = importlib.import_module(
            "service.api." + str(path.relative_to(ROOT).with_suffix("")).replace("/", "."))
        for name in raised_names(path):
            if name in CAUGHT or name in NEVER_ANSWERED:
                continue
            cls: Any = getattr(module, name, None) or getattr(builtins, name, None)
            if cls is None or handlers.answer_of(cls.__new__(cls)) is None:
                unanswered.append(f"{path.name}: {name}")
    assert not unanswered, unanswered


def test_the_lower_layers_errors_raised_at_admission_are_answered() -> None:
    """What VideoService.create lets through from the router (admission) and the results
    storage, and what add_lora lets through from the models."""
    for cls in (QuotaExceeded, QueueFull, Unavailable, StorageError, LoraLimit, LoraError):
        assert cls in handlers.ANSWERS


def test_a_refusal_counts_only_where_the_route_asked() -> None:
    """The LoRA route's 413 is not a refused video: only a create marks its request."""
    counted, plain = request(), request()
    handlers.count_refusals(counted)
    assert getattr(counted.state, handlers._COUNTED) and not getattr(plain.state, handlers._COUNTED, False)


def test_an_error_without_an_answer_is_not_swallowed() -> None:
    with pytest.raises(ZeroDivisionError):
        handlers.respond(ZeroDivisionError("a bug"), request())
