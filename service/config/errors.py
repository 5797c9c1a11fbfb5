"""The errors of bad values: a setting (a flag or the Serve config) and a field of a request."""

from __future__ import annotations


class FlagError(ValueError):
    """A flag (or Serve config field) is invalid; the message names it."""


class FieldError(ValueError):
    """A value is invalid; ``field`` names it (``cache.threshold``, ``num_frames``) for HTTP 422
    bodies and CLI errors. Base of the request's and the step cache's errors."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # pickled with the constructor's arguments: a rank's refusal must reach the driver as
        # itself, never as an unpicklable error that reads as the rank's death
        return type(self), (self.field, self.message)
