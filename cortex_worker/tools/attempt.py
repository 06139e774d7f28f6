"""Which attempt of which action a tool call is, for tools that deduplicate side effects.

Actions run at least once: a re-run (a retry, or a lost worker's action sent again) calls the
tool again. Every call knows its `Attempt`: built-ins as `ctx.identity` (and
`ctx.idempotency_key`, `ctx.attempt`); any code a tool runs, through `current()`: in the worker
(built-ins, MCP calls) while `tools.runtime.run_tool` runs it, in a sandboxed process (python
tools, `@tool` functions included; the `python` built-in; shell and docker tools read the
variables themselves) from its environment (`ENV`). Stdlib only, besides the key's one
definition: the API loads the MCP client, which imports this, and tool code in the sandbox does.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from cortex_worker.actions.call import idempotency_key

ENV = ("CORTEX_JOB_ID", "CORTEX_ACTION_ID", "CORTEX_ATTEMPT", "CORTEX_IDEMPOTENCY_KEY")
"""The variables every sandboxed tool process and docker container gets (`Attempt.env`)."""


@dataclass(frozen=True)
class Attempt:
    """One run of one action: a tool that must not repeat a side effect when its action runs
    again keys it on `idempotency_key`, which every attempt shares."""

    job_id: str
    action_id: str
    attempt: int = 1
    """1 on the action's first run, one more on each retry or re-run of a lost one."""

    @property
    def idempotency_key(self) -> str:
        """`<job_id>:<action_id>`: the same on every attempt of the action."""
        return idempotency_key(self.job_id, self.action_id)

    def env(self) -> dict[str, str]:
        """The environment variables that carry it to a tool's process (`ENV`)."""
        return dict(zip(ENV, (self.job_id, self.action_id, str(self.attempt),
                              self.idempotency_key), strict=True))


_running: ContextVar[Attempt | None] = ContextVar("cortex_tool_attempt", default=None)


@contextlib.contextmanager
def running(attempt: Attempt) -> Iterator[None]:
    """Make `attempt` the one `current()` answers in this thread while its tool runs."""
    token = _running.set(attempt)
    try:
        yield
    finally:
        _running.reset(token)


def current() -> Attempt:
    """The attempt whose tool runs here: in the worker the one `running` set, in a tool's
    sandboxed process the one in its environment. LookupError outside a tool call."""
    attempt = _running.get()
    if attempt is not None:
        return attempt
    try:
        return Attempt(os.environ["CORTEX_JOB_ID"], os.environ["CORTEX_ACTION_ID"],
                       int(os.environ["CORTEX_ATTEMPT"]))
    except (KeyError, ValueError):
        raise LookupError("not in a tool call: no CORTEX_JOB_ID, CORTEX_ACTION_ID and "
                          "CORTEX_ATTEMPT in the environment") from None
