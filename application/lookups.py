"""Errors for an identifier that names nothing: raised by the use cases, reported as "not found"
by every entrypoint. Kept apart so that an entrypoint can name them without loading the use
cases that raise them."""

from __future__ import annotations

from ql3.domain.errors import Error


class UnknownAttempt(Error, LookupError):
    """No Attempt with that id."""
