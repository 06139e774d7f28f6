"""The one vocabulary of a job's life: job and action statuses, event types, and the event.

The engine writes these words (the Lua scripts in store/lua spell them too: a unit test checks
each against this module), and the API, the client, `follow`, AG-UI and the job page read them.
Import-light on purpose: the API and the client import it, so it needs only pydantic.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class JobStatus(StrEnum):
    """The life of a job."""

    # the docstring is the API schema's description; the moves: docs/architecture.md

    queued = "queued"
    running = "running"
    finishing = "finishing"
    completed = "completed"
    failed = "failed"
    cancelled = "cancelled"


#: A job in one of these has ended: nothing more runs or is logged for it.
JOB_TERMINAL = frozenset({JobStatus.completed, JobStatus.failed, JobStatus.cancelled})
#: A job not ended yet.
JOB_LIVE = frozenset(JobStatus) - JOB_TERMINAL


class ActionStatus(StrEnum):
    """An action's field in the job's `status` hash (docs/architecture.md, action states)."""

    pending = "pending"  # registered; dependencies not ended
    waiting = "waiting"  # ready, parked by the parallelism limit
    awaiting_approval = "awaiting_approval"  # ready, held for a person's answer
    queued = "queued"  # sent to its pool
    running = "running"  # claimed by a worker
    ok = "ok"
    error = "error"
    timeout = "timeout"
    skipped = "skipped"  # a dependency did not succeed
    cancelled = "cancelled"  # the job ended first


#: An action in one of these has its result recorded (once).
ACTION_TERMINAL = frozenset({ActionStatus.ok, ActionStatus.error, ActionStatus.timeout,
                             ActionStatus.skipped, ActionStatus.cancelled})
#: The ends that count as a failure of the action itself (not one it never ran for).
ACTION_FAILED = frozenset({ActionStatus.error, ActionStatus.timeout})


class EventType(StrEnum):
    """Every type of event a job's log holds (docs/runtime.md#events lists their `data`)."""

    # the job and its turns
    job_queued = "job_queued"
    job_started = "job_started"
    turn_started = "turn_started"
    usage = "usage"
    model_waiting = "model_waiting"
    turn_completed = "turn_completed"
    child_job = "child_job"
    job_completed = "job_completed"
    job_failed = "job_failed"
    job_cancelled = "job_cancelled"
    # the parse of a document or of a model's stream (protocol.parser)
    text = "text"
    thought_chunk = "thought_chunk"
    thought_end = "thought_end"
    response_chunk = "response_chunk"
    context_feed = "context_feed"
    action_parsed = "action_parsed"
    protocol_error = "protocol_error"
    warning = "warning"
    # actions
    action_queued = "action_queued"
    action_started = "action_started"
    action_retrying = "action_retrying"
    action_completed = "action_completed"
    action_failed = "action_failed"
    action_skipped = "action_skipped"
    action_cancelled = "action_cancelled"
    approval_requested = "approval_requested"
    action_approved = "action_approved"
    action_rejected = "action_rejected"
    # at run time
    response_end = "response_end"
    feed_updated = "feed_updated"


#: The event that ends a job in each final status (`close.lua` logs it last). Keyed by str:
#: statuses read from Redis are plain strings.
END_EVENTS: dict[str, EventType] = {
    JobStatus.completed: EventType.job_completed,
    JobStatus.failed: EventType.job_failed,
    JobStatus.cancelled: EventType.job_cancelled,
}
#: The types of a job's last event: a stream closes after one of them.
TERMINAL_EVENTS = frozenset(END_EVENTS.values())
#: The events that record an action's end, and the status each implies when its data has none.
ACTION_END_EVENTS: dict[str, ActionStatus] = {
    EventType.action_completed: ActionStatus.ok,
    EventType.action_failed: ActionStatus.error,
    EventType.action_skipped: ActionStatus.skipped,
    EventType.action_cancelled: ActionStatus.cancelled,
}


class Event(BaseModel):
    """One entry of a job's event log, as stored (the stream field `e`) and served (SSE
    `data:`); `data` depends on `type`. Readers validate it; the engine's emit path does not."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    seq: int = Field(description="1, 2, 3... without gaps: the SSE id to resume after")
    ts: float = Field(description="Unix seconds")
    type: str = Field(description="an `EventType` (kept a plain string, so a type added later "
                                  "still reads)")
    data: dict[str, Any] = Field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        """Whether this is the job's last event (`job_completed`, `job_failed`, `job_cancelled`)."""
        return self.type in TERMINAL_EVENTS
