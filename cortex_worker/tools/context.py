"""What a running tool knows about its action: ids, attempt, workspace, time budget, settings."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from cortex_worker.sandbox import isolation
from cortex_worker.settings import Settings
from cortex_worker.tools.attempt import Attempt

JOB_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


@dataclass(frozen=True)
class ToolContext:
    """The action a tool runs for; `workspace` is the job's directory, `timeout` in seconds,
    `attempt` this run's number (`tools.attempt`)."""

    job_id: str
    action_id: str
    workspace: Path
    timeout: float
    settings: Settings
    attempt: int = 1

    @property
    def identity(self) -> Attempt:
        """Which attempt of which action this is."""
        return Attempt(self.job_id, self.action_id, self.attempt)

    @property
    def idempotency_key(self) -> str:
        """The same on every attempt of the action (`Attempt.idempotency_key`)."""
        return self.identity.idempotency_key

    @classmethod
    def for_job(
        cls, settings: Settings, job_id: str, action_id: str, timeout: float | None = None
    ) -> ToolContext:
        """A context with the job's workspace created and the default timeout if none given."""
        return cls(
            job_id=job_id,
            action_id=action_id,
            workspace=workspace_for(settings, job_id),
            timeout=timeout if timeout is not None else settings.default_action_timeout_s,
            settings=settings,
        )


def workspace_for(settings: Settings, job_id: str) -> Path:
    """Create (if needed) and return `workspace_root/<job_id>`, resolved."""
    if not JOB_ID.match(job_id):
        raise ValueError(
            f"invalid job id {job_id!r}: use 1-128 letters, digits, '_' or '-' "
            "(it names the job's workspace directory)"
        )
    path = settings.workspace_root.expanduser().resolve() / job_id
    path.mkdir(parents=True, exist_ok=True)
    user = tool_user(settings)
    if user is not None and path.stat().st_uid != user[0]:
        os.chown(path, *user)  # tool code runs as this user and writes here
    return path


def tool_user(settings: Settings) -> tuple[int, int] | None:
    """(uid, gid) that tool code runs as, which owns the workspaces; None: the worker's own.

    A root worker switches to `sandbox_user` when namespaces isolate its tools (they make the
    interpreter readable to that user, see cortex_worker/sandbox/isolation.py)."""
    if settings.sandbox_isolation == "off" or isolation.unavailable_reason() is not None:
        return None
    return isolation.sandbox_user(settings.sandbox_user)

