"""The error a request body raises before any compute: a 422 (or a subclass's status) naming the field.

Its own module so that ``schemas`` (the body) and ``images`` (its ``input_reference``) both
raise it without importing each other.
"""

from __future__ import annotations


class BodyError(ValueError):
    """The body is unreadable or a field is invalid; becomes a 422 naming ``field``."""

    def __init__(self, field: str, message: str, kind: str = "value_error") -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message, self.kind = field, message, kind

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:
        # pickled with the constructor's arguments (Ray rebuilds a rank's error in the caller)
        return type(self), (self.field, self.message, self.kind)
