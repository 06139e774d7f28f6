"""Errors a tool raises to fail its action cleanly (the message is shown to the agent)."""

from __future__ import annotations

from cortex_worker.errors import ActionFailed


class ToolError(ActionFailed):
    """A clean action failure; `message` says what went wrong, `detail` holds logs (stderr…)."""

    def __init__(self, message: str, *, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail


class ToolTimeout(ToolError):
    """The tool ran out of time."""
