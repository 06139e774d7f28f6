"""The job record: a job's Redis hash, typed, with its field encoding in one place.

The hash holds strings; the Lua scripts read and count some fields (`status`, `remaining`,
`running`, `failures`, `limit`, `ttl`, `turn*`), so those stay plain numbers and words. Lists
and objects are JSON, flags are "1"/"0". `JobRecord.from_hash` and `encode` are the only code
that knows this.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from cortex_worker.jobs.options import JobOptions
from cortex_worker.protocol.events import JOB_TERMINAL
from cortex_worker.store.keys import DEFAULT_TTL_S

JobKindName = Literal["document", "workflow", "agent"]
#: The tenant of jobs and sessions created without API keys configured.
DEFAULT_TENANT = "default"

#: Fields stored as JSON, and flags stored as "1"/"0".
_JSON_FIELDS = frozenset({"options", "model", "responses", "inputs", "actions", "output",
                          "pending_responses", "feedback", "planner", "native_calls"})
_FLAGS = frozenset({"closed", "final", "remind"})


class JobRecord(BaseModel):
    """One job's hash. Fields a kind does not use keep their defaults."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str
    kind: JobKindName = "document"
    status: str = "queued"  # a `JobStatus` (protocol.events), kept a str as the scripts write it
    tenant: str = DEFAULT_TENANT
    created_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    progress_at: float | None = None  # its last event (set by every event the scripts log)
    ttl: int = DEFAULT_TTL_S
    # counters kept by the scripts: registered and unfinished, running now, failed
    remaining: int = 0
    running: int = 0
    failures: int = 0
    closed: bool = False  # no more actions will be registered until the next turn
    limit: int = 1  # running actions at once (max_parallel)
    depth: int = 0  # nesting: 0 for a job nobody's action started
    options: JobOptions = JobOptions()
    model: dict[str, Any] | None = None  # the model of its llm actions (documents, workflows)
    parent_job: str | None = None
    parent_action: str | None = None
    request: str = ""  # a digest of the request that made it, if it came with an idempotency key
    dispatch: str | None = None  # "canvas" or "readiness" (documents and workflows)
    result: str = ""
    result_type: str = ""  # "json": `result` is the JSON of a typed output (output_schema)
    error: str = ""
    # documents
    document: str = ""
    responses: list[dict[str, Any]] = []
    # workflows
    workflow: str | None = None
    inputs: Any = None
    actions: list[dict[str, Any]] = []
    output: dict[str, Any] = {}
    # agents
    agent: str | None = None
    input: str = ""
    session: str | None = None
    final: bool = False  # a final response was written; the job ends once nothing is awaited
    reminders: int = 0  # idle turns in a row
    remind: bool = False  # the next prompt carries the protocol reminder
    feedback: list[dict[str, Any]] = []  # protocol errors for the next prompt
    planner: dict[str, Any] = {}  # the StreamPlanner, serialised
    pending_responses: list[dict[str, Any]] = []  # rendered when the turn's actions are done
    native_calls: list[dict[str, Any]] = []  # the last turn's native tool calls (id, action_id)
    turn: int = 0  # the turn in progress (counted as it begins)
    turns: int | None = None  # turns run, once the job ended
    turn_owner: str = ""
    turn_phase: str = ""
    turn_lease: float | None = None
    turn_fence: int = 0  # the turn's fencing number: grows with each grant (resume.lua)
    turn_taken_from: str = ""  # the owner the last takeover took the turn from
    turn_waiter: str = ""  # the process whose turn waits in place for the job to drain
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @classmethod
    def from_hash(cls, data: Mapping[str, str]) -> JobRecord:
        """Decode a job hash (or the fields read of one)."""
        values: dict[str, Any] = {}
        for name, raw in data.items():
            if name in _JSON_FIELDS:
                values[name] = _loads(raw)
            elif name in _FLAGS:
                values[name] = raw == "1"
            elif raw != "" or name in _TEXT:  # an empty number or id is "not set"
                values[name] = raw
        return cls.model_validate(values)

    @property
    def parent(self) -> tuple[str, str] | None:
        """(job id, action id) of the action that started this job, if one did."""
        if self.parent_job and self.parent_action:
            return self.parent_job, self.parent_action
        return None

    @property
    def ended(self) -> bool:
        return self.status in JOB_TERMINAL

    @property
    def begun_at(self) -> float:
        """When it started running (its creation, if it has not)."""
        return self.started_at or self.created_at


_TEXT = frozenset(name for name, info in JobRecord.model_fields.items() if info.annotation is str)


def encode(fields: Mapping[str, Any]) -> dict[str, str]:
    """Record fields as hash values (the inverse of `JobRecord.from_hash`)."""
    out: dict[str, str] = {}
    for name, value in fields.items():
        if name in _JSON_FIELDS:
            out[name] = value.model_dump_json() if isinstance(value, BaseModel) else _dumps(value)
        elif name in _FLAGS or isinstance(value, bool):
            out[name] = "1" if value else "0"
        elif value is None:
            out[name] = ""
        elif isinstance(value, float):
            out[name] = repr(value)
        else:
            out[name] = str(value)
    return out


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)


def _loads(raw: str) -> Any:
    """JSON, or the text itself (a record written before the field was JSON)."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw or None
