"""The one tree of errors Cortex raises on purpose; `CortexError` is its root.

Everything a caller may catch derives from it, so the API maps errors to HTTP in one place
and a worker tells a clean failure from a bug.
"""

from __future__ import annotations

from typing import Any


class CortexError(Exception):
    """Root of every error Cortex raises on purpose; `message` is shown to whoever asked."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class SubmitError(CortexError, ValueError):
    """A job that cannot run; `errors` have kind, message, line and column."""

    def __init__(self, message: str, errors: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.errors = errors
