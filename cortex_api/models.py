"""Request and response bodies of the REST API (`/v1`)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from cortex_worker.jobs.options import JobOptions
from cortex_worker.jobs.record import JobRecord
from cortex_worker.protocol.events import ActionStatus, JobStatus

__all__ = ["ActionView", "HealthStatus", "JobCreate", "JobCreated", "JobLinks", "JobList",
           "JobOptions", "JobStatus", "JobStatusView", "JobSummary", "JobView", "ModelUsage",
           "Readiness", "UsageReport",
           "ValidateRequest"]


# -- requests -----------------------------------------------------------------------------
class JobCreate(BaseModel):
    """`POST /v1/jobs`: run a protocol document, or an agent on an input."""

    model_config = ConfigDict(extra="forbid")

    protocol: str | None = Field(default=None, description="A protocol document to run.")
    agent: str | None = Field(default=None, description="An agent to run on `input`.")
    input: str | None = Field(default=None, description="The agent's task (with `agent`).")
    workflow: str | None = Field(default=None, description="A workflow to run on `inputs`.")
    inputs: dict[str, Any] = Field(default_factory=dict,
                                   description="The workflow's inputs (with `workflow`).")
    options: JobOptions = Field(default_factory=JobOptions)

    @model_validator(mode="after")
    def _one_kind(self) -> JobCreate:
        given = [k for k in ("protocol", "agent", "workflow") if getattr(self, k) is not None]
        if len(given) != 1:
            raise PydanticCustomError(
                "missing", "give exactly one of `protocol` (a document to run), `agent` with "
                "`input`, or `workflow` with `inputs`")
        if self.inputs and self.workflow is None:
            raise PydanticCustomError("invalid", "`inputs` goes with `workflow`")
        if self.agent is not None and not (self.input or "").strip():
            raise PydanticCustomError("missing", "`input` is required with `agent`: the agent's task")
        return self


class SessionCreate(BaseModel):
    """`POST /v1/sessions`: a conversation with an agent."""

    model_config = ConfigDict(extra="forbid")

    agent: str
    options: JobOptions = Field(default_factory=JobOptions)


class MessageCreate(BaseModel):
    """`POST /v1/sessions/{id}/messages`: the user's next message."""

    model_config = ConfigDict(extra="forbid")

    content: str = Field(min_length=1, max_length=200_000)


class SessionView(BaseModel):
    """A session: its agent, its messages so far and its jobs."""

    id: str
    agent: str
    created_at: float
    messages: list[dict[str, Any]]
    jobs: list[str]


class ValidateRequest(BaseModel):
    """`POST /v1/validate`: parse a document without running it."""

    model_config = ConfigDict(extra="forbid")

    protocol: str = Field(description="The protocol document to check.")


# -- responses ----------------------------------------------------------------------------
class JobLinks(BaseModel):
    """Where to find a job's view, its event stream and how to cancel it (paths)."""

    self: str
    events: str
    cancel: str

    @classmethod
    def for_job(cls, job_id: str) -> JobLinks:
        base = f"/v1/jobs/{job_id}"
        return cls(self=base, events=f"{base}/events", cancel=f"{base}/cancel")


class JobCreated(BaseModel):
    """The answer to `POST /v1/jobs`: the job is queued."""

    id: str
    status: str
    links: JobLinks


class JobStatusView(BaseModel):
    """A job's id and status."""

    id: str
    status: str


class ApprovalAnswer(BaseModel):
    """A person's answer to an action's approval request."""

    model_config = ConfigDict(extra="forbid")

    reason: str | None = Field(default=None, max_length=2000,
                               description="why; a rejection's reason reaches the model")


class ApprovalDecision(BaseModel):
    """An approval request, answered."""

    job_id: str
    action_id: str
    decision: Literal["approved", "rejected"]


class ActionView(BaseModel):
    """One action of a job: its spec, state and outcome. Times are Unix seconds."""

    id: str
    type: str | None = None
    mode: str | None = None
    name: str | None = None
    output_key: str | None = None
    status: str
    attempts: int = 0
    depends_on: list[str] = Field(default_factory=list)
    after: list[str] = Field(default_factory=list)
    started_at: float | None = None
    finished_at: float | None = None
    duration_ms: float | None = None
    result: Any = Field(default=None, description="The value of an action that succeeded.")
    error: str | None = None
    truncated: bool = False

    @classmethod
    def from_store(cls, action_id: str, entry: dict[str, Any]) -> ActionView:
        """Build from one value of `Store.actions()` (`spec`, `status`, `attempts`, `result`)."""
        spec = entry.get("spec") or {}
        record = entry.get("result") or {}
        started, finished = _time(record.get("started_at")), _time(record.get("finished_at"))
        duration = record.get("duration_ms")
        if duration is None and started is not None and finished is not None:
            duration = round((finished - started) * 1000, 3)
        error = record.get("error")
        return cls(
            id=action_id, type=spec.get("type"), mode=spec.get("mode"), name=spec.get("name"),
            output_key=spec.get("output_key"), status=entry.get("status") or ActionStatus.pending,
            attempts=int(entry.get("attempts") or 0),
            depends_on=list(spec.get("depends_on") or []), after=list(spec.get("after") or []),
            started_at=started, finished_at=finished, duration_ms=duration,
            result=record.get("value"), error=None if error is None else str(error),
            truncated=bool(record.get("truncated")))


class JobSummary(BaseModel):
    """A job as listed: enough for a dashboard row. Times are Unix seconds."""

    id: str
    status: str
    kind: str | None = Field(default=None, description="`document`, `agent` or `workflow`")
    agent: str | None = None
    created_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    counts: dict[str, int] = Field(default_factory=dict,
                                   description="actions per status, and `total`")

    @classmethod
    def _fields(cls, job: JobRecord) -> dict[str, Any]:
        return {"id": job.id, "status": job.status, "kind": job.kind, "agent": job.agent,
                "created_at": job.created_at or None, "started_at": job.started_at,
                "finished_at": job.finished_at, "error": job.error or None}

    @classmethod
    def from_store(cls, job: JobRecord, statuses: Iterable[str] = ()) -> JobSummary:
        """Build from the job hash (`Store.peek`) and its actions' statuses."""
        return cls(**cls._fields(job), counts=action_counts(statuses))


class ModelUsage(BaseModel):
    """What requests to one model endpoint spent."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    requests: int = 0


class UsageReport(BaseModel):
    """A tenant's model usage over a range of UTC days, by endpoint and in all."""

    tenant: str
    from_: str | None = Field(default=None, alias="from", description="the first day (UTC)")
    to: str | None = Field(default=None, description="the last day (UTC), included")
    endpoints: dict[str, ModelUsage]
    total: ModelUsage


class JobView(JobSummary):
    """A job with its actions, in document order, and how many are in each status."""

    result: Any = Field(default=None, description="The rendered final response; for an agent "
                        "with an output_schema, its parsed value (any JSON).")
    turns: int | None = Field(default=None, description="agent jobs: turns run")
    parent_job: str | None = Field(default=None, description="the job whose action started this one")
    parent_action: str | None = None
    session: str | None = None
    last_progress_at: float | None = Field(
        default=None, description="when the job last logged an event (Unix seconds): a job "
        "that is running and has not moved for long is one the reconciler looks at")
    actions: list[ActionView] = Field(default_factory=list)
    usage: dict[str, ModelUsage] = Field(
        default_factory=dict, description="model requests by endpoint (answered ones: their "
        "prompt and completion tokens)")

    @classmethod
    def from_store(cls, job: JobRecord, actions: dict[str, dict[str, Any]] | None = None,
                   usage: dict[str, dict[str, int]] | None = None) -> JobView:
        """Build from `Store.get_job`, `Store.actions` and the job's usage (`jobs.usage`)."""
        entries = sorted((actions or {}).items(), key=lambda kv: _document_order(*kv))
        views = [ActionView.from_store(action_id, entry) for action_id, entry in entries]
        result = json.loads(job.result) if job.result_type == "json" else job.result or None
        return cls(**cls._fields(job), result=result, actions=views,
                   counts=action_counts(view.status for view in views),
                   turns=job.turns, parent_job=job.parent_job,
                   parent_action=job.parent_action, session=job.session,
                   last_progress_at=job.progress_at,
                   usage={e: ModelUsage(**counts) for e, counts in (usage or {}).items()})


class JobList(BaseModel):
    """A page of jobs, newest first."""

    items: list[JobSummary]
    limit: int
    offset: int
    next_offset: int | None = Field(default=None, description="offset of the next page, if any")


class HealthStatus(BaseModel):
    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    """Whether Redis answers and every required pool has a worker."""

    status: Literal["ready", "not_ready"]
    redis: bool
    pools: dict[str, int] = Field(default_factory=dict, description="workers per pool queue")
    required: list[str] = Field(default_factory=list)
    missing: list[str] = Field(default_factory=list, description="required pools with no worker")
    error: str | None = None


def action_counts(statuses: Iterable[str]) -> dict[str, int]:
    """Actions per status, and `total`."""
    counts = dict(Counter(statuses))
    counts["total"] = sum(counts.values())
    return counts


def _time(value: Any) -> float | None:
    if value is None or value == "":
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _document_order(action_id: str, entry: dict[str, Any]) -> tuple[int, int, str]:
    spec = entry.get("spec") or {}
    return int(spec.get("line") or 0), int(spec.get("column") or 0), action_id
