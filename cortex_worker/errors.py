"""The one tree of errors Cortex raises on purpose; `CortexError` is its root.

Everything a caller may catch derives from it, so the API maps errors to HTTP in one place
(`cortex_api.errors`) and a worker tells a clean failure from a bug. Each class lives next to
the code that raises it; a second base (ValueError, LookupError, RuntimeError) is kept where
callers catch it by that name.

    CortexError                          message: shown to whoever asked
    ├── SubmitError (ValueError)         a job that cannot run; errors           (here)
    ├── AlreadySubmitted                 job_id: the job a repeated request made (here)
    ├── ActionFailed                     an action failed cleanly; the agent sees why (here)
    │   ├── ToolError                    detail (logs)               tools.errors
    │   │   ├── ToolTimeout                                          tools.errors
    │   │   └── RelicCallError           kind                        relics.spec
    │   └── ModelError                   retryable, status, streamed llm.stream
    ├── ManifestError (ValueError)       a manifest that cannot be loaded        manifests
    ├── UnknownAgentError (LookupError)                                          manifests
    ├── UnknownWorkflowError (LookupError)                                       manifests
    ├── FeedError (ValueError)           a context feed refused or failed        feeds
    ├── SandboxError (RuntimeError)      a command that cannot be started        sandbox.process
    ├── ActionError (ValueError)         an action's fields are invalid; kind    protocol.actions
    ├── PathError (ValueError)           a variable path that does not resolve   protocol.variables
    ├── JSONBodyError (ValueError)       invalid JSON in an action body          protocol.lenient_json
    ├── AuthConfigError (ValueError)     API keys that cannot be loaded          cortex_api.auth
    ├── StackError (RuntimeError)        a process of `cortex up` did not start  cortex_api.stack
    └── SessionBusy                      job_id: the session's job that blocks   store

Not in the tree, on purpose: `actions.call.Deferred` (control flow: a child job will record
the outcome), `cortex_api.limits.BodyTooLarge` (already an HTTP response) and
`cortex_api.stack.Interrupted` (a KeyboardInterrupt).

This module imports nothing from Cortex: it is the bottom of the import graph.
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


class AlreadySubmitted(CortexError):
    """A request sent again with its idempotency key (`jobs.lifecycle.Once`): `job_id` is
    the job the first copy made, and nothing new was made."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"this request was submitted already: job {job_id}")
        self.job_id = job_id


class QuotaExceededError(CortexError):
    """The tenant has spent its token budget (`Settings.quotas`): no job is accepted until
    it renews (the API answers 429)."""


class ActionFailed(CortexError):
    """An action failed cleanly: its outcome is `failed` and the agent is shown `message`.

    Raised as one of its kinds: `ToolError` (a tool, relic or internal action) or
    `ModelError` (a model call).
    """
