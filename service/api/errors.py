"""The errors the API answers, each with its answer: HTTP status, error code, OpenAI error type,
and the ``dloserve_requests`` status label a refused create counts as.

An error class of the api layer carries its ``Answer`` (``answer = Answer(...)``); the errors of
the layers below (router, models), which the batch job shares and which know no HTTP, get
theirs in one table (``handlers.ANSWERS``). One handler (``handlers.answer``) turns either into
the response: routes raise, they do not build error responses.

Its own module, light (no FastAPI, no torch), so that ``schemas`` (the body), ``images`` (its
``input_reference``), ``keys`` and ``http`` all raise from it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class Answer:
    """How the API answers one error class.

    ``metric``: the status label of ``dloserve_requests`` when a create (POST /v1/videos,
    /v1/videos/sync) is refused for it; None: not counted. ``param``: the field it names when
    the class always names the same one; ``param_attr``: the error's attribute that names it
    otherwise (for the layers below, whose errors are not ``ApiError``). ``headers``: fixed
    ones; an error with ``retry_after_s`` adds Retry-After.
    """

    status: int
    code: str
    type: str = "invalid_request_error"  # the OpenAI error body's "type"
    metric: str | None = None
    param: str | None = None
    param_attr: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    where: str = "body"  # the FastAPI ``detail`` location of ``param``


class ApiError(Exception):
    """An error of the api layer: its class carries the answer; ``param``, ``code`` and extra
    ``headers`` may be the instance's own (a body error names its field and pydantic's error
    type; a sync create's 404 names the job it made)."""

    answer: ClassVar[Answer]  # each subclass's own

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        own = getattr(type(self), "answer", None)  # (none on ApiError itself: not an answer)
        self.message = message
        self.param = param if param is not None or own is None else own.param
        self.code = code or (own.code if own is not None else None)
        self.headers = headers or {}

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled with what it was made of (Ray rebuilds a rank's or an actor's error in the caller)
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type[ApiError], args: tuple[Any, ...], state: dict[str, Any]) -> ApiError:
    e = cls.__new__(cls)
    Exception.__init__(e, *args)
    e.__dict__.update(state)
    return e


class BodyError(ApiError, ValueError):
    """The body is unreadable or a field is invalid: 422 naming ``field``, with ``code`` the
    kind of error (pydantic's type, ``json_invalid``, ``value_error``)."""

    answer = Answer(422, "value_error", metric="rejected")

    def __init__(self, field: str, message: str, code: str = "value_error") -> None:
        super().__init__(message, field, code)
        self.field = field
        self.args = (f"{field}: {message}",)

    @property
    def kind(self) -> str:
        """Its ``code`` (the name this error gave it before it carried an ``Answer``)."""
        return self.code


class Draining(ApiError):
    """The service is stopping: new work is refused."""

    answer = Answer(503, "draining", type="server_error", headers=(("Retry-After", "30"),))


class NotFound(ApiError):
    """No such video or adapter (or another key's: its existence is not told either)."""

    answer = Answer(404, "not_found")


class ModelNotFound(ApiError):
    """This service runs another model."""

    answer = Answer(404, "model_not_found", param="model")


class NotReady(ApiError):
    """The video has not completed: it has no content yet."""

    answer = Answer(409, "not_ready", param="video_id")


class ForbiddenSource(ApiError, PermissionError):
    """An adapter file outside the --lora-dir folders (or registration is off)."""

    answer = Answer(403, "forbidden_source", param="source")


class LoraExists(ApiError, KeyError):
    """The adapter name is taken, by the caller or by the server."""

    answer = Answer(409, "lora_exists", param="name")

    def __str__(self) -> str:  # a KeyError would print its repr
        return self.message
