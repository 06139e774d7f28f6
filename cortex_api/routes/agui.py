"""AG-UI: `POST /v1/agents/{name}/ag-ui` runs an agent for an AG-UI client (`@ag-ui/client`'s
`HttpAgent`, CopilotKit): a `RunAgentInput` in, AG-UI events out as server-sent events.

A thin layer over sessions and jobs, never a second engine. A thread is a session of the agent
(`thread_session`, created on first use; the last message, the user's, is the job's input); a
run is a job, or after an interrupt the next part of the same job's log. Each run is recorded
(`Store.claim_agui_run`) so that posting its id again attaches to it instead of starting
another job. A job that waits for a person's approval ends its run with an interrupt; the next
run's `resume` answers it (`decide_approval`) and streams the job from there. The run's
`tools` are the job's client tools (`JobOptions.client_tools`): a call to one is held like an
approval and ends the run with its TOOL_CALL_* events; the next run's `tool` messages answering
those calls are their results (`answer_client_call`) and the same job goes on. The events are
those of `?format=ag-ui` (cortex_api.agui), under the same SSE ids: `Last-Event-ID` resumes.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any

from ag_ui.core import RunAgentInput, ToolMessage, UserMessage
from fastapi import APIRouter, Header, Path
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from cortex_api.agui import AgUi, AgUiRun
from cortex_api.auth import Caller, CallerDep
from cortex_api.deps import HubDep, SettingsDep, StoreDep
from cortex_api.errors import api_error, responses
from cortex_api.sse import (
    Event,
    EventHub,
    EventStreamResponse,
    history,
    job_events,
    resume_point,
    sse_comment,
    sse_message,
)
from cortex_worker.errors import CortexError
from cortex_worker.handles import get_registry
from cortex_worker.jobs.approvals import AWAITING
from cortex_worker.jobs.lifecycle import answer_client_call, decide_approval, submit_agent
from cortex_worker.jobs.options import ClientTool, JobOptions
from cortex_worker.protocol.events import JOB_TERMINAL
from cortex_worker.settings import Settings
from cortex_worker.store.state import SessionBusy, SessionTurn, Store, dumps

router = APIRouter(prefix="/v1/agents", tags=["ag-ui"])

#: How long a post of a run id waits for the post that claimed it to start its job.
CLAIM_WAIT_S = 10.0
CLAIM_POLL_S = 0.05
#: A run claimed this long ago whose job is still unknown never started (its API process
#: died between the claim and the submit): the claim is dropped.
STALE_CLAIM_S = 60.0
#: While an approval is awaited, how often a stream asks whether the job now waits only for
#: people (its run then ends with an interrupt); events ask too, as they come.
PAUSE_POLL_S = 0.5


class CortexProps(BaseModel):
    """`forwardedProps.cortex`: Cortex's settings of a thread, read when it is created."""

    model_config = ConfigDict(extra="forbid")

    options: JobOptions = Field(default_factory=JobOptions,
                                description="the job options of the thread's runs")


class ApprovalPayload(BaseModel):
    """A resume entry's `payload` for an approval interrupt (`agui.APPROVAL_SCHEMA`)."""

    approved: bool
    reason: str | None = Field(default=None, max_length=2000)


class RunRefused(CortexError):
    """A run that cannot start (or go on): its stream is one RUN_ERROR with `code`."""

    def __init__(self, message: str, code: str = "run_refused") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Pending:
    """Where a job's last run ended waiting: its seq, its open interrupts (approvals) by id,
    and the client tool calls it waits for (tool call id -> action id)."""

    until: int
    interrupts: dict[str, AgUi]
    calls: dict[str, str]


@dataclass(frozen=True, slots=True)
class Run:
    """What a run streams: its job's events after `start`, to the job's end or `until`."""

    session_id: str
    run_id: str
    job_id: str
    start: int
    until: int | None


def thread_session(tenant: str, agent: str, thread_id: str) -> str:
    """The session of an AG-UI thread: derived from it, so that a thread needs no key of its
    own and the same thread id of another tenant or agent is another session."""
    digest = hashlib.sha256(f"{tenant}\0{agent}\0{thread_id}".encode()).hexdigest()
    return f"agui-{digest[:32]}"


@router.post("/{name}/ag-ui", status_code=200, response_class=EventStreamResponse,
             responses={200: {"content": {"text/event-stream": {}},
                              "description": "AG-UI events, one per message: `id: <seq>`, "
                                             "`data: <AG-UI event JSON>`"},
                        **responses(400, 404, 422)})
async def run_agent(name: Annotated[str, Path(description="the agent")], body: RunAgentInput,
                    store: StoreDep, hub: HubDep, settings: SettingsDep, caller: CallerDep,
                    last_event_id: Annotated[str | None, Header(
                        description="resume the run after this seq")] = None
                    ) -> EventStreamResponse:
    """Run agent `name` for an AG-UI client: the thread is a session, the run a job (a run
    id posted again attaches to it and replays it); answers the run's AG-UI events.

    The events are those of `GET /v1/jobs/{id}/events?format=ag-ui`, under the client's
    thread and run ids, after a `CUSTOM` event `cortex.run` naming the job. An action
    awaiting approval ends the run with an interrupt; the next run's `resume` answers it and
    the same job goes on. The run's `tools` (frontend tools) are offered to the model: a call
    to one ends the run with the call, and the next run's `tool` messages are its results.
    A run that cannot start is one `RUN_ERROR`. See
    [integrations](integrations.md#ag-ui)."""
    if name not in get_registry().agents:
        raise api_error(404, f"no agent named {name!r}", agents=sorted(get_registry().agents))
    props = _props(body.forwarded_props)
    try:
        after = resume_point(last_event_id)
    except ValueError as exc:
        raise api_error(400, str(exc)) from None
    try:
        run = await run_in_threadpool(_prepare, store, settings, caller, name, body, props)
    except RunRefused as refused:
        return EventStreamResponse(_refusal(refused))
    return EventStreamResponse(_stream(hub, store, body, run, after))


def _props(forwarded: Any) -> CortexProps:
    """`forwardedProps.cortex`, if given; 422 if it is not valid."""
    if not isinstance(forwarded, dict) or forwarded.get("cortex") is None:
        return CortexProps()
    try:
        return CortexProps.model_validate(forwarded["cortex"])
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise api_error(422, f"invalid request (body.forwardedProps.cortex.{where}): "
                             f"{first['msg']}") from None


# -- starting, resuming and attaching (sync: the Store) ----------------------------------
def _prepare(store: Store, settings: Settings, caller: Caller, agent: str, body: RunAgentInput,
             props: CortexProps) -> Run:
    """The run the body names: attached to if posted before, else started (RunRefused)."""
    session_id = thread_session(caller.tenant, agent, body.thread_id)
    runs = store.agui_runs(session_id)
    if body.run_id in runs:
        return _attach(store, session_id, body.run_id)
    session = store.get_session(session_id)
    last_job: str | None = session["jobs"][-1] if session and session["jobs"] else None
    if body.resume or _answers(body):
        return _resume(store, session_id, body, runs, last_job, caller)
    text = _user_text(body)  # a 422 before the thread is created
    if session is None:
        store.create_session(session_id, agent, props.options.model_dump(),
                             settings.event_retention_s, tenant=caller.tenant)
        session = store.get_session(session_id)
        assert session is not None
    return _start(store, session, body, text, runs, last_job, caller)


def _attach(store: Store, session_id: str, run_id: str) -> Run:
    """An existing run, once its job is known (the post that claimed it may still start it)."""
    deadline = time.monotonic() + CLAIM_WAIT_S
    while True:
        record = store.agui_runs(session_id).get(run_id)
        if record is None:
            raise RunRefused(f"run {run_id!r} could not start; post a new run",
                             code="run_not_started")
        if record["job"] is not None:
            return Run(session_id, run_id, record["job"], record["after"], record["until"])
        if time.time() - record["at"] > STALE_CLAIM_S:  # its API process died mid-start
            store.drop_agui_run(session_id, run_id)
            raise RunRefused(f"run {run_id!r} could not start; post it again",
                             code="run_not_started")
        if time.monotonic() > deadline:
            raise RunRefused(f"run {run_id!r} is still starting; post it again",
                             code="run_starting")
        time.sleep(CLAIM_POLL_S)


def _start(store: Store, session: dict[str, Any], body: RunAgentInput, text: str,
           runs: dict[str, dict[str, Any]], last_job: str | None, caller: Caller) -> Run:
    """A new message: the session's next job, whose input is `text`, the user's message."""
    session_id = session["id"]
    pending = _pending(store, session_id, runs, last_job) if last_job is not None else None
    if pending is not None:
        wants = (["answers to its interrupts (in `resume`)"] if pending.interrupts else []) \
            + (["the results of its frontend tool calls (as `tool` messages)"]
               if pending.calls else [])
        raise RunRefused(f"the thread waits for {' and '.join(wants)}", code="interrupted")
    options = JobOptions.model_validate_json(session.get("options") or "{}")
    try:
        client = [ClientTool(name=tool.name, description=tool.description,
                             parameters=tool.parameters) for tool in body.tools or []]
    except ValidationError as exc:
        raise RunRefused(f"invalid frontend tool: {exc.errors()[0]['msg']}",
                         code="invalid_tools") from None
    history = [{"role": m["role"], "content": m["content"]} for m in session["messages"]] \
        or _client_history(body)
    record = {"job": None, "after": 0, "until": None, "at": time.time()}
    if not store.claim_agui_run(session_id, body.run_id, record):
        return _attach(store, session_id, body.run_id)
    try:
        job_id = submit_agent(
            store, session["agent"], text, history=history,
            options=options.model_copy(update={"client_tools": client}),
            session=SessionTurn(session_id, last_job),
            tenant=session.get("tenant") or caller.tenant)
    except SessionBusy as exc:
        store.drop_agui_run(session_id, body.run_id)
        raise RunRefused(f"{exc.message} (the thread's run is still going)",
                         code="thread_busy") from None
    except CortexError as exc:
        store.drop_agui_run(session_id, body.run_id)
        raise RunRefused(exc.message, code=type(exc).__name__) from None
    store.settle_agui_run(session_id, body.run_id, job=job_id)
    return Run(session_id, body.run_id, job_id, 0, None)


def _resume(store: Store, session_id: str, body: RunAgentInput,
            runs: dict[str, dict[str, Any]], last_job: str | None, caller: Caller) -> Run:
    """A run that answers what the thread's last run ended waiting for: its interrupts (in
    `resume`, every one) and its frontend tool calls (`tool` messages); the same job goes on."""
    pending = _pending(store, session_id, runs, last_job) if last_job else None
    if pending is None or last_job is None:
        raise RunRefused("nothing to resume: the thread has no open interrupts nor frontend "
                         "tool calls", code="no_interrupt")
    decisions = _decisions(body, pending.interrupts)
    results = {call: message for call, message in _tool_results(body).items()
               if call in pending.calls}
    if not decisions and not results:
        raise RunRefused("the run answers none of the thread's frontend tool calls: send "
                         f"`tool` messages for {', '.join(sorted(pending.calls))}",
                         code="unanswered_tool_call")
    record = {"job": last_job, "after": pending.until, "until": None, "at": time.time()}
    if not store.claim_agui_run(session_id, body.run_id, record):
        return _attach(store, session_id, body.run_id)
    by = f"ag-ui, tenant {caller.tenant}" if caller.enforced else "ag-ui"
    for ident, (approve, reason) in decisions.items():
        action_id = pending.interrupts[ident]["metadata"]["cortex"]["actionId"]
        decide_approval(store, last_job, action_id, approve=approve, by=by, reason=reason)
    for call, message in results.items():
        answer_client_call(store, last_job, pending.calls[call], message.content,
                           error=message.error)
    return Run(session_id, body.run_id, last_job, pending.until, None)


def _decisions(body: RunAgentInput,
               interrupts: dict[str, AgUi]) -> dict[str, tuple[bool, str | None]]:
    """`resume`'s answers to the open interrupts, by interrupt id (RunRefused unless it
    answers each one, and only those)."""
    answers = {entry.interrupt_id: entry for entry in body.resume or []}
    unknown = sorted(set(answers) - set(interrupts))
    if unknown:
        raise RunRefused(f"no open interrupt {unknown[0]!r} on this thread",
                         code="unknown_interrupt")
    missing = sorted(set(interrupts) - set(answers))
    if missing:
        raise RunRefused(f"resume must answer every open interrupt; {', '.join(missing)} "
                         "has no answer", code="unanswered_interrupt")
    decisions: dict[str, tuple[bool, str | None]] = {}
    for ident, entry in answers.items():
        interrupt = interrupts[ident]
        if entry.status == "cancelled":
            decisions[ident] = (False, "cancelled by the user")
            continue
        if _expired(interrupt):
            raise RunRefused(f"interrupt {ident!r} expired at {interrupt['expiresAt']}",
                             code="interrupt_expired")
        try:
            payload = ApprovalPayload.model_validate(entry.payload)
        except ValidationError as exc:
            raise RunRefused(f"interrupt {ident!r}: the payload must be {{approved: boolean, "
                             f"reason?: string}} ({exc.errors()[0]['msg']})",
                             code="invalid_resume") from None
        decisions[ident] = (payload.approved, payload.reason)
    return decisions


def _answers(body: RunAgentInput) -> bool:
    """Whether the run answers frontend tool calls: its last message is a `tool` message."""
    return bool(body.messages) and isinstance(body.messages[-1], ToolMessage)


def _tool_results(body: RunAgentInput) -> dict[str, ToolMessage]:
    """The `tool` messages at the end of the run's messages (after the last assistant or user
    message: the answers to the last run's calls), by tool call id."""
    out: dict[str, ToolMessage] = {}
    for message in reversed(body.messages):
        if not isinstance(message, ToolMessage):
            break
        out.setdefault(message.tool_call_id, message)
    return out


def _pending(store: Store, session_id: str, runs: dict[str, dict[str, Any]],
             job_id: str) -> Pending | None:
    """Where the job's last run ended waiting for people or for its client; None if it does
    not wait for any (it runs, ended, or was not started by a run)."""
    mine = [(run_id, r) for run_id, r in runs.items() if r["job"] == job_id]
    if not mine:
        return None
    run_id, record = max(mine, key=lambda item: item[1]["at"])
    status = store.peek(job_id, "status")
    if status is None or status.status in JOB_TERMINAL:
        return None
    until = record["until"]
    if until is None:
        paused = store.waiting_for_people(job_id)
        if paused is None:
            return None
        until = (store.settle_agui_run(session_id, run_id, until=paused) or {}).get("until")
        if until is None:
            return None
    run = AgUiRun(job_id, "", run_id, session_id=session_id, start=record["after"], until=until)
    for event in store.events_after(job_id, 0, until):
        run.seen(event)
    requested = {action for action, approval in store.approvals(job_id).items()
                 if approval.get("state") == "requested"}  # not answered since, nor expired
    open_ = {interrupt["id"]: interrupt for interrupt in run.interrupts()
             if interrupt["metadata"]["cortex"]["actionId"] in requested}
    statuses = store.action_statuses(job_id)
    calls = {call: action for call, action in run.client_calls().items()
             if action in requested and statuses.get(action) == AWAITING}  # not answered
    return Pending(until, open_, calls) if open_ or calls else None


def _expired(interrupt: AgUi) -> bool:
    expires = interrupt.get("expiresAt")
    return expires is not None and datetime.fromisoformat(expires) <= datetime.now(UTC)


def _user_text(body: RunAgentInput) -> str:
    """The job's input: the last message, which must be the user's, as text."""
    last = body.messages[-1] if body.messages else None
    if not isinstance(last, UserMessage):
        raise api_error(422, "invalid request (body.messages): the last message must be the "
                             "user's: it is the run's input")
    text = _text(last.content)
    if not text.strip():
        raise api_error(422, "invalid request (body.messages): the user's last message has no "
                             "text")
    return text


def _text(content: Any) -> str:
    """A message's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content or [] if getattr(part, "type", "") == "text")


def _client_history(body: RunAgentInput) -> list[dict[str, Any]]:
    """A new thread's conversation as the client holds it (its user and assistant texts,
    before the last message): the session starts from it."""
    out = []
    for message in body.messages[:-1]:
        text = _text(getattr(message, "content", None))
        if message.role in ("user", "assistant") and text:
            out.append({"role": message.role, "content": text})
    return out


# -- streaming (async: the hub) ----------------------------------------------------------
async def _stream(hub: EventHub, store: Store, body: RunAgentInput, run: Run,
                  after: int) -> AsyncIterator[str]:
    """The run's AG-UI events after seq `after` (its start, if earlier), until it ends."""
    agui = AgUiRun(run.job_id, body.thread_id, run.run_id, session_id=run.session_id,
                   start=run.start, until=run.until)
    join = max(run.start, after)
    async for event in history(hub, run.job_id, join):
        agui.seen(event)
    if agui.ended:
        return
    async with aclosing(job_events(hub, run.job_id, join)) as items:
        step = asyncio.ensure_future(_next(items))
        try:
            while True:
                wait = PAUSE_POLL_S if agui.awaiting and agui.until is None else None
                done, _ = await asyncio.wait({step}, timeout=wait)
                if step in done:
                    item = step.result()
                    if item is None:
                        return
                    text = sse_comment(item) if isinstance(item, str) else _sse(agui(item))
                    if text:
                        yield text
                    if agui.ended:
                        return
                    step = asyncio.ensure_future(_next(items))
                if agui.awaiting and agui.until is None:
                    until = await run_in_threadpool(_paused, store, run)
                    if until is not None:
                        text = _sse(agui.pause(until))
                        if text:
                            yield text
                        if agui.ended:
                            return
        finally:
            step.cancel()
            with suppress(asyncio.CancelledError, StopAsyncIteration):
                await step


async def _next(items: AsyncIterator[Event | str]) -> Event | str | None:
    """The stream's next item, None at its end (a task: waiting for it can time out)."""
    return await anext(items, None)


def _paused(store: Store, run: Run) -> int | None:
    """Where the run ends if its job now waits only for people (recorded once)."""
    paused = store.waiting_for_people(run.job_id)
    if paused is None:
        return None
    record = store.settle_agui_run(run.session_id, run.run_id, until=paused)
    return None if record is None else record["until"]


def _sse(items: list[tuple[int, AgUi]]) -> str:
    return "".join(sse_message(dumps(item), id=seq) for seq, item in items)


async def _refusal(refused: RunRefused) -> AsyncIterator[str]:
    """A run that could not start: RUN_ERROR, which AG-UI's verifier takes as a first event."""
    event = {"type": "RUN_ERROR", "code": refused.code, "message": refused.message}
    yield sse_message(dumps(event))
