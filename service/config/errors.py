"""The one error a bad setting raises, whether it came from a flag or the Serve config."""

from __future__ import annotations


class FlagError(ValueError):
    """A flag (or Serve config field) is invalid; the message names it."""
