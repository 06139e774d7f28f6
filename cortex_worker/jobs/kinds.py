"""The three job kinds, one class each: what differs between documents, workflows and agents.

`jobs` runs the one job state machine and asks the kind (`KINDS[record.kind]`) at each
step: how to start, what to do when nothing is left to wait for, what the outcome is, and
what to do as the job ends. A kind decides; it never ends a job itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from cortex_worker.actions import dispatch
from cortex_worker.handles import get_registry
from cortex_worker.jobs.record import JobKindName, JobRecord
from cortex_worker.llm.config import ModelConfig
from cortex_worker.plan.dag import Plan
from cortex_worker.protocol import parser as p
from cortex_worker.protocol.actions import Action
from cortex_worker.protocol.document import Document, load_document
from cortex_worker.protocol.variables import find_references, render
from cortex_worker.store.state import Store, dumps
from cortex_worker.workflows import spec as wf
from cortex_worker.workflows.output import failure_message, output_names, render_output

Event = tuple[str, dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Start:
    """A whole plan to start: log `events`, seed `variables`, register and dispatch `plan`."""

    plan: Plan
    events: list[Event]
    variables: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a drained job ends: `completed` with `result`, or `failed` with `error`."""

    result: Any = None
    error: str = ""
    events: list[Event] = field(default_factory=list)

    @property
    def status(self) -> str:
        return "failed" if self.error else "completed"


class JobKind(Protocol):
    """What the job state machine asks of a kind."""

    name: ClassVar[JobKindName]

    def send_start(self, job_id: str) -> None:
        """Queue the job's first step (on the agent pool)."""

    def start(self, store: Store, job: JobRecord) -> Start | None:
        """The whole plan, for kinds that know it up front; None: it plans as it goes."""

    def on_drained(self, store: Store, job: JobRecord) -> bool:
        """Nothing is left to wait for: True if the job is done (`finish` it)."""

    def finish(self, store: Store, job: JobRecord) -> Outcome:
        """The outcome of a job that is done."""

    def ending(self, store: Store, job: JobRecord, status: str, result: Any,
               error: str | None) -> None:
        """Just before the job ends with `status`, whatever ended it."""

    def model(self, job: JobRecord) -> ModelConfig | None:
        """The model of the job's llm actions and feeds, if it has one."""


class _PlannedKind:
    """Documents and workflows: the whole plan is known at the start."""

    def send_start(self, job_id: str) -> None:
        dispatch.start_job(job_id)

    def on_drained(self, store: Store, job: JobRecord) -> bool:
        return True

    def ending(self, store: Store, job: JobRecord, status: str, result: Any,
               error: str | None) -> None:
        return None

    def model(self, job: JobRecord) -> ModelConfig | None:
        return None if job.model is None else ModelConfig.from_wire(job.model)


class DocumentKind(_PlannedKind):
    """A protocol document: its actions, then its responses rendered with their results."""

    name: ClassVar[JobKindName] = "document"

    def start(self, store: Store, job: JobRecord) -> Start:
        doc = load_document(job.document)
        assert doc.plan is not None  # it was checked at submit
        return Start(doc.plan, [("job_started", {"kind": "document"}), *parse_events(doc)],
                     doc.feeds)

    def finish(self, store: Store, job: JobRecord) -> Outcome:
        events, result = render_responses(store, job.id, job.responses)
        error = f"{job.failures} action(s) failed" if job.failures else ""
        return Outcome(result, error, events)


class WorkflowKind(_PlannedKind):
    """A workflow run: its steps (stored at submit), then its output template."""

    name: ClassVar[JobKindName] = "workflow"

    def start(self, store: Store, job: JobRecord) -> Start:
        actions = [Action.model_validate(a) for a in job.actions]
        events = [("job_started", {"kind": "workflow", "workflow": job.workflow}),
                  *[(p.ACTION_PARSED, {"action": a.model_dump(mode="json")}) for a in actions]]
        return Start(wf.workflow_plan(actions), events)  # `inputs` was seeded at submit

    def finish(self, store: Store, job: JobRecord) -> Outcome:
        name = job.workflow or "?"
        if job.failures:
            return Outcome(error=failure_message(name, store.actions(job.id)))
        template, default = job.output.get("template"), job.output.get("default") or ""
        values = store.variables(job.id, output_names(template, default))
        result, unresolved = render_output(template, default, values)
        warnings = [("warning", {"kind": "unresolved_reference", "message": f"{u.text} in the "
                                 f"output of workflow {name!r} was left as written: {u.reason}"})
                    for u in unresolved]
        return Outcome(result, "", warnings)


class AgentKind:
    """An agent: turns (see `coordinator`), each planned as the model streams it."""

    name: ClassVar[JobKindName] = "agent"

    def send_start(self, job_id: str) -> None:
        dispatch.agent_turn(job_id)

    def start(self, store: Store, job: JobRecord) -> None:
        return None

    def on_drained(self, store: Store, job: JobRecord) -> bool:
        dispatch.agent_turn(job.id)  # the turn decides whether the job is done
        return False

    def finish(self, store: Store, job: JobRecord) -> Outcome:
        raise TypeError("an agent job's turns end it (coordinator), never a drained plan")

    def ending(self, store: Store, job: JobRecord, status: str, result: Any,
               error: str | None) -> None:
        if job.session:  # before the job ends, so the session's next message sees this reply
            store.append_session(job.session, {
                "role": "assistant", "job_id": job.id,
                "content": (result if isinstance(result, str) else dumps(result))
                if status == "completed" else f"[the job ended {status}: {error}]"})

    def model(self, job: JobRecord) -> ModelConfig | None:
        spec = get_registry().agents.get(job.agent or "")
        return None if spec is None else spec.model.named(job.options.model)


KINDS: dict[str, JobKind] = {kind.name: kind for kind in (DocumentKind(), WorkflowKind(), AgentKind())}


def render_responses(store: Store, job_id: str, responses: Sequence[dict[str, Any]]
                     ) -> tuple[list[Event], str | None]:
    """`response_end` events with the job's variables filled in, and the last final text."""
    names = {ref for r in responses for ref in find_references(r["text"])}
    values = store.variables(job_id, names)
    events: list[Event] = []
    final = None
    for response in responses:
        text, _ = render(response["text"], values)
        events.append(("response_end", {"final": response["final"], "text": text}))
        if response["final"]:
            final = text
    return events, final


def parse_events(doc: Document) -> list[Event]:
    """The document's parse as log events (chunks joined); responses end when rendered."""
    out: list[Event] = []
    for event in p.coalesce(doc.events):
        if event.type == p.RESPONSE_END:
            continue
        data = event.data
        if event.type == p.ACTION_PARSED:
            data = {"action": data["action"].model_dump(mode="json"), "end": data["end"]}
        out.append((event.type, data))
    return out
