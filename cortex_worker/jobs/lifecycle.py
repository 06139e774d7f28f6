"""The job state machine: submit, start, drain, finish and cancel, for every kind.

What differs between documents, workflows and agents is asked of their `kinds.JobKind`;
the moves are made here, and `end_job` is the one place any job ends. The API calls
`submit_*` and `cancel_job`; the `agent` pool runs `start_job` and the agent turns
(`coordinator`); the worker that finishes a job's last action calls `on_drained`, and one
that runs an agent or workflow action calls `submit_child`, through the hooks this module
installs in the executor (which sits below the jobs and never imports them).
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cortex_worker.actions import dispatch, executor
from cortex_worker.actions.call import ChildJob
from cortex_worker.actions.table import ACTION_TYPES, Target
from cortex_worker.agents.prompt import function_name
from cortex_worker.agents.spec import AgentSpec
from cortex_worker.errors import AlreadySubmitted, SubmitError
from cortex_worker.handles import get_registry
from cortex_worker.jobs import approvals, tenants, usage
from cortex_worker.jobs.kinds import KINDS, Start
from cortex_worker.jobs.options import JobOptions
from cortex_worker.jobs.record import DEFAULT_TENANT, JobKindName, JobRecord
from cortex_worker.observability import tracing
from cortex_worker.plan.canvas import decompose
from cortex_worker.plan.dag import Plan
from cortex_worker.protocol.actions import Action
from cortex_worker.protocol.document import Document, load_document
from cortex_worker.protocol.events import END_EVENTS, EventType, JobStatus
from cortex_worker.recovery.owners import CHILD_OWNER
from cortex_worker.settings import Settings, get_settings
from cortex_worker.store.state import SessionTurn, Store, dumps
from cortex_worker.workflows import spec as wf


def _problem(kind: str, message: str, line: int = 1, column: int = 1) -> dict[str, Any]:
    return {"kind": kind, "message": message, "line": line, "column": column}


def check_document(doc: Document) -> list[dict[str, Any]]:
    """Errors that stop a parsed document from running here: parse, plan and registry errors."""
    errors = [{k: e[k] for k in ("kind", "message", "line", "column")} for e in doc.errors]
    settings = get_settings()
    if len(doc.actions) > settings.max_actions_per_job:
        errors.append(_problem("too_many_actions", f"{len(doc.actions)} actions; at most "
                               f"{settings.max_actions_per_job} are allowed per job"))
    registry = get_registry()
    for action in doc.actions:
        target = Target(f"action {action.id!r}", action.name, action.parameters, registry, settings)
        errors.extend(_problem(kind, message, action.line, action.column)
                      for kind, message in ACTION_TYPES[action.type.value].check(target))
    return errors


def document_report(doc: Document) -> dict[str, Any]:
    """`cortex validate --json`'s report (and `POST /v1/validate`'s): the parse and plan, with
    every error that submitting the document here would meet, in document order."""
    report = doc.to_json()
    report["errors"] = sorted(check_document(doc), key=lambda e: (e["line"], e["column"]))
    return report


#: How deep jobs may nest (a child's depth is its parent's + 1), unless the parent is an agent
#: job: then its manifest's `max_depth` is the limit.
MAX_DEPTH = 8


def model_of_document(settings: Settings, options: JobOptions) -> dict[str, Any]:
    """The `model` field of a document job (its llm actions'): `document_model` (the
    `kind: Model` it names, if a name), with the job option `model` as its model name."""
    model = settings.document_model
    if model is None:
        return {}
    if isinstance(model, str):
        model = get_registry().model(model)
    return {"model": model.named(options.model).wire()}


def submit_document(store: Store, text: str, *, options: JobOptions | None = None,
                    tenant: str | None = None, once: Once | None = None) -> str:
    """Validate `text`, create its job and queue its start; returns the job id (`once`:
    AlreadySubmitted if this request made its job already)."""
    settings = get_settings()
    options = options or JobOptions()
    size = len(text.encode())
    if size > settings.max_document_bytes:
        raise SubmitError("document too large", [_problem(
            "too_large", f"document is {size} bytes; the limit is {settings.max_document_bytes}")])
    doc = load_document(text)
    errors = check_document(doc)
    if errors:
        raise SubmitError(f"the document has {len(errors)} error(s)", errors)
    return _create(store, NewJob("document", {
        "document": text,
        "responses": [{"final": r["final"], "text": r["text"]} for r in doc.responses],
        **model_of_document(settings, options),
    }, {"actions": len(doc.actions)}, options=options, tenant=tenant, once=once))


def submit_workflow(store: Store, name: str, inputs: Any, *, options: JobOptions | None = None,
                    parent: tuple[str, str] | None = None, depth: int = 0,
                    tenant: str | None = None, once: Once | None = None) -> str:
    """Validate `inputs`, create the workflow's job and queue its start; returns the job id.
    The job's actions are the workflow's steps; its `inputs` variable is the inputs object
    (the schema's top-level defaults filled in)."""
    registry = get_registry()
    flow = registry.workflows.get(name)
    if flow is None:
        known = ", ".join(sorted(registry.workflows)) or "none"
        message = f"no workflow named {name!r} (registered: {known})"
        raise SubmitError(message, [_problem("unknown_workflow", message)])
    if isinstance(inputs, dict):
        inputs = flow.prepare_inputs(inputs)
    problems = flow.input_errors(inputs)
    if problems:
        errors = [{**_problem("invalid_inputs", f"workflow {name!r}: {text}"), "path": path}
                  for path, text in problems]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise SubmitError(errors[0]["message"] + more, errors)
    actions = flow.actions()
    fields: dict[str, Any] = {
        "workflow": flow.name, "inputs": inputs,
        "actions": [a.model_dump(mode="json") for a in actions],
        "output": {"template": flow.output, "default": flow.last_step},
    }
    if flow.model is not None:
        fields["model"] = flow.model.wire()
    return _create(store, NewJob("workflow", fields, {"workflow": flow.name,
                                                      "steps": len(actions)},
                                 options=options, parent=parent, depth=depth, tenant=tenant,
                                 variables={wf.INPUTS: inputs}, once=once))


def submit_agent(store: Store, agent: str, text: str, *, options: JobOptions | None = None,
                 parent: tuple[str, str] | None = None, depth: int = 0,
                 history: list[dict[str, Any]] | None = None, session: SessionTurn | None = None,
                 tenant: str | None = None, once: Once | None = None) -> str:
    """Create an agent job (`agent` must be registered) and queue its first turn; with
    `session`, as that session's next message (SessionBusy if it cannot take one now)."""
    spec = get_registry().agent(agent)
    if options is not None:
        _check_client_tools(spec, options)
    fields: dict[str, Any] = {"agent": spec.name, "input": text}
    periodic = {f.id: f for f in spec.context_feeds if f.type == "periodic" and f.enabled}
    return _create(store, NewJob("agent", fields, {"agent": spec.name}, options=options,
                                 parent=parent, depth=depth, tenant=tenant, history=history,
                                 feeds=periodic, session=session, once=once))


def _check_client_tools(agent: AgentSpec, options: JobOptions) -> None:
    """A client tool may not share a name (nor a native function's name) with one of the
    agent's tools or another client tool: a call must name one tool only."""
    own = {function_name(name): name for name in agent.tools}
    seen: dict[str, str] = {}
    for tool in options.client_tools:
        key = function_name(tool.name)
        if key in own:
            whose = f"tool {own[key]!r} of agent {agent.name!r}"
        elif key in seen:
            whose = f"client tool {seen[key]!r}"
        else:
            seen[key] = tool.name
            continue
        message = f"client tool {tool.name!r} clashes with {whose}: give it another name"
        raise SubmitError(message, [_problem("client_tool_clash", message)])


@dataclass(frozen=True, slots=True)
class Once:
    """A request its client may send more than once (an `Idempotency-Key`, an A2A message
    id): every copy finds the job the first one made while that job is kept, and makes
    nothing. Its job's id is derived from the key and the tenant; the same key with another
    request is refused."""

    key: str
    request: str
    """A digest of what was asked (`Once.of`)."""

    @classmethod
    def of(cls, key: str, request: Any) -> Once:
        """`key` for `request` (any JSON value: the body as the client sent it)."""
        canonical = json.dumps(request, sort_keys=True, separators=(",", ":"), default=str)
        return cls(key, hashlib.sha256(canonical.encode()).hexdigest())

    def job_id(self, tenant: str) -> str:
        return uuid.uuid5(uuid.NAMESPACE_URL, f"cortex-once:{tenant}:{self.key}").hex


@dataclass(frozen=True, slots=True)
class NewJob:
    """A job to create, of any kind: what `_create` writes and sends for it."""

    kind: JobKindName
    fields: dict[str, Any]
    """The record's fields of this kind (`JobRecord`)."""
    queued: dict[str, Any]
    """What its `job_queued` event says of it."""
    options: JobOptions | None = None
    parent: tuple[str, str] | None = None
    """The action that asked for it: (job id, action id)."""
    depth: int = 0
    tenant: str | None = None
    variables: dict[str, Any] | None = None
    history: list[dict[str, Any]] | None = None
    """The conversation so far (an agent's, in a session)."""
    feeds: dict[str, Any] | None = None
    """An agent's periodic context feeds, refreshed from its creation on."""
    session: SessionTurn | None = None
    once: Once | None = None


def _create(store: Store, new: NewJob) -> str:
    """The bookkeeping every kind shares: create the record, link a child to its parent, and
    queue the first step. A job asked for again gets the same id, and is found instead of
    made again (and its start is sent again if it has not started): a child of an action
    (`parent`: job id, action id), as a redelivered action asks again, and a request sent
    again with its idempotency key (`once`: AlreadySubmitted, see `resubmitted`)."""
    settings = get_settings()
    kind, fields, parent, tenant, session, once = new.kind, new.fields, new.parent, \
        new.tenant, new.session, new.once
    options = new.options or JobOptions()
    if parent:  # one child per parent action, even if its task is delivered twice
        job_id = child_job_id(*parent)
        tenant = (store.peek(parent[0], "tenant") or JobRecord(id="")).tenant  # never leaves it
    elif once:
        found = resubmitted(store, once, tenant)
        if found is not None:
            raise AlreadySubmitted(found)
        job_id = once.job_id(tenant or DEFAULT_TENANT)
    else:
        job_id = uuid.uuid4().hex
    if not parent:
        usage.check_submit(store, tenant or DEFAULT_TENANT)
    record: dict[str, Any] = {
        "kind": kind, "tenant": tenant or DEFAULT_TENANT, "options": options, "depth": new.depth,
        "limit": options.max_parallel or settings.max_parallel_actions, **fields}
    if session:
        record["session"] = session.session_id
    if parent:
        record.update(parent_job=parent[0], parent_action=parent[1])
    if once:
        record["request"] = once.request
    links = {"parent_job": parent[0], "parent_action": parent[1], "depth": new.depth} \
        if parent else {}
    # a session's message is recorded with the job, before the job can reply to it
    existing = store.create_job(
        job_id, record, settings.event_retention_s,
        [(EventType.job_queued, {"kind": kind, **new.queued, **links})], session=session,
        variables=new.variables, conversation=new.history or ())
    if existing is not None:  # made meanwhile, or before: found, not made again
        if once:
            raise AlreadySubmitted(resubmitted(store, once, tenant) or job_id)
        if existing.status == "queued":
            KINDS[kind].send_start(job_id)
        return job_id
    if parent and not _adopt(store, parent, job_id):
        return job_id
    if new.feeds:
        dispatch.refresh_feeds(job_id, new.feeds)
    KINDS[kind].send_start(job_id)
    return job_id


def resubmitted(store: Store, once: Once, tenant: str | None) -> str | None:
    """The job `once`'s request made already, if it is kept (its start is sent again if it
    has not started: the first request may have stopped before it sent it), else None.
    SubmitError if its key made a job for another request."""
    job_id = once.job_id(tenant or DEFAULT_TENANT)
    job = store.peek(job_id, "kind", "status", "request")
    if job is None:
        return None
    if job.request != once.request:
        message = (f"idempotency key {once.key!r} was used for another request (job {job_id}): "
                   "use a new key for a new request")
        raise SubmitError(message, [_problem("idempotency_key_reused", message)])
    if job.status == "queued":
        KINDS[job.kind].send_start(job_id)
    return job_id


def submit_child(store: Store, job_id: str, action_id: str, child: ChildJob) -> str:
    """Start the child job an action asked for (once: its id is derived from the action).
    The one nesting rule: a child's depth (its parent's + 1) may not exceed `MAX_DEPTH`, or
    an agent parent's `max_depth`. The child inherits the parent's options."""
    parent = store.peek(job_id, "kind", "agent", "depth", "options")
    if parent is None:
        raise SubmitError(f"job {job_id} has expired", [])
    limit = MAX_DEPTH
    if parent.kind == "agent" and parent.agent in get_registry().agents:
        limit = get_registry().agents[parent.agent].max_depth
    depth = parent.depth + 1
    if depth > limit:
        message = f"{child.kind} {child.name!r}: nesting depth limit ({limit}) reached"
        raise SubmitError(message, [_problem("too_deep", message)])
    link = (job_id, action_id)
    if child.kind == "agent":
        child_id = submit_agent(store, child.name, child.input, parent=link, depth=depth)
    else:
        child_id = submit_workflow(store, child.name, child.input, options=parent.options,
                                   parent=link, depth=depth)
    store.hand_over(job_id, action_id, CHILD_OWNER + child_id)  # its worker is free to go
    return child_id


def _adopt(store: Store, parent: tuple[str, str], child: str) -> bool:
    """Link a new child job to its parent. False if the parent has ended: the child is then
    cancelled here, since the parent's own cancel may have listed its children before this one
    was added (it adds before it looks; a parent ends before it lists)."""
    store.add_child(parent[0], child)
    store.emit(parent[0], [(EventType.child_job, {"action_id": parent[1], "job_id": child})], live=True)
    status = store.peek(parent[0], "status")
    if status is not None and not status.ended:
        return True
    cancel_job(store, child, reason=f"its parent job {parent[0]} ended")
    return False


def action_entry(plan: Plan, action_id: str,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The stored form of a planned action (as the `register` script and tasks take it);
    `extra` adds spec fields (what the action inherits from its job)."""
    node = plan.nodes[action_id]
    spec = {**node.action.model_dump(mode="json"), **(extra or {})}
    spec["depends_on"], spec["after"] = list(node.depends_on), list(node.after)
    return {"id": action_id, "spec": json.dumps(spec), "deps": list(node.depends_on),
            "after": list(node.after), "on_error": node.action.on_error.value}


def start_job(store: Store, job_id: str) -> None:
    """Run a queued document or workflow job (the start task, on the agent pool): log its
    start, seed its variables, dispatch what is ready (see `start_plan`)."""
    job = store.get_job(job_id)
    if job is None or job.status not in ("queued", "running"):
        return
    if job.status == "queued" and not tenants.admitted(store, job):
        dispatch.start_job(job_id, countdown=tenants.ADMIT_AGAIN_S)  # its tenant is at its cap
        return
    start = KINDS[job.kind].start(store, job)
    if start is not None:
        start_plan(store, job, start)


def _inherited(job: JobRecord, action: Action) -> dict[str, Any]:
    """Spec fields an action takes from its job: nesting depth, and llm actions' model."""
    extra: dict[str, Any] = {}
    if job.depth:
        extra["depth"] = job.depth
    if ACTION_TYPES[action.type.value].needs_model and job.model:
        extra["model"] = job.model
    return extra


def start_plan(store: Store, job: JobRecord, start: Start) -> None:
    """Start a job whose whole plan is known (a document, a workflow): log its events, seed
    its variables, register every action, and dispatch: one canvas mirroring a
    series-parallel plan, otherwise each action when it is ready."""
    job_id, plan = job.id, start.plan
    store.set_variables(job_id, start.variables)  # first: a start redelivered later finds them
    begun = store.begin(job_id, start.events)  # atomic: a job cancelled meanwhile stays cancelled
    if begun == "ended":
        return
    redelivered = begun == "running"  # a worker died while starting it
    step = None
    entries = [action_entry(plan, a, _inherited(job, plan.nodes[a].action)) for a in plan.nodes]
    gated = any(approvals.required(json.loads(e["spec"]), get_registry()) for e in entries)
    if not gated and (job.options.canvas if job.options.canvas is not None
                      else get_settings().canvas):  # a chain cannot wait for a person
        step = decompose(plan)
        if step is not None and step.width() > job.limit:
            step = None
    store.set_job(job_id, dispatch="canvas" if step else "readiness")
    result = store.register(job_id, entries, close=True)
    if not result.recorded:
        return  # cancelled while starting
    if step is not None:
        specs = {e["id"]: json.loads(e["spec"]) for e in entries}
        dispatch.send_canvas(job_id, step, specs)
    else:
        ready = {r["id"] for r in result.ready}
        if redelivered:  # what was queued may never have been sent; duplicates are harmless
            ready |= store.ids_with_status(job_id, "queued")
        dispatch.send(job_id, [json.loads(e["spec"]) for e in entries if e["id"] in ready])
    if result.drained:
        on_drained(store, job_id)


def on_drained(store: Store, job_id: str) -> None:
    """Nothing is left to wait for: the job's kind says whether it is done (an agent job
    takes its next turn instead)."""
    job = store.get_job(job_id)
    if job is None or job.status != JobStatus.finishing:
        return
    if KINDS[job.kind].on_drained(store, job):
        finalize(store, job)


def child_job_id(parent_job: str, parent_action: str) -> str:
    """The id of the one child job an agent or workflow action starts (stable on redelivery)."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"cortex:{parent_job}:{parent_action}").hex


def finalize(store: Store, job: JobRecord) -> None:
    """End a drained job with its kind's outcome (once)."""
    outcome = KINDS[job.kind].finish(store, job)
    summary = {"status": outcome.status, "result": outcome.result, "error": outcome.error or None,
               "duration_ms": round((time.time() - job.begun_at) * 1000, 3)}
    result = outcome.result
    text = "" if result is None else result if isinstance(result, str) else dumps(result)
    end_job(store, job.id, outcome.status, summary, {"result": text, "error": outcome.error},
            events=outcome.events, only_if=JobStatus.finishing, result=result)


def end_job(store: Store, job_id: str, status: str, data: dict[str, Any],
            fields: dict[str, Any], *, events: Sequence[tuple[str, dict[str, Any]]] = (),
            only_if: str = "", result: Any = None, notify: bool = True,
            job: JobRecord | None = None, fence: int | None = None) -> bool:
    """The one place a job ends, whatever its kind: log `events` and `job_<status>` (`data`),
    cancel what is unfinished (unless it completed), revoke what runs, cancel its children,
    and hand the outcome (`result`, or `data["error"]`) to the action that started it (unless
    `notify` is False: that action ends otherwise). False if it had already ended (or was
    not `only_if`). `job`: its record, if the caller has just read it (`close` checks its
    status again). `fence`: the ending turn's; a turn taken over ends nothing (fencing)."""
    job = job or store.get_job(job_id)
    if job is None or job.ended or (fence is not None and job.turn_fence != fence):
        return False
    error = data.get("error") or data.get("reason")
    KINDS[job.kind].ending(store, job, status, result, error)
    kind = END_EVENTS.get(status, EventType.job_failed)
    ended = store.close(job_id, status, fields, [*events, (kind, data)], only_if=only_if,
                        fence=fence)
    if ended is None:
        return False
    dispatch.revoke(job_id, ended)
    tenants.release(store, job)
    tracing.record_job(job_id, job.created_at, status, {
        "cortex.job.kind": job.kind, "cortex.agent": job.agent or "", **(
            {"error.type": "job_" + status, "cortex.job.error": str(error)} if error else {})})
    if status != "completed":
        cancel_children(store, job_id)
    if notify:
        _notify_parent(store, job, status, result, error)
    return True


def cancel_job(store: Store, job_id: str, *, status: str = "cancelled",
               reason: str = "cancelled by request", notify: bool = True) -> bool:
    """End a job now (cancel, or `failed` for fail_fast). False if it had already ended."""
    return end_job(store, job_id, status, {"status": status, "reason": reason}, {"error": reason},
                   notify=notify)


def cancel_children(store: Store, job_id: str) -> None:
    """Cancel the child jobs (agent and workflow actions) of a job that ended early."""
    for child in store.children(job_id):
        cancel_job(store, child, reason=f"its parent job {job_id} ended")


def _notify_parent(store: Store, job: JobRecord, status: str, result: Any,
                   error: str | None) -> None:
    """A child job ended: its outcome completes or fails the parent's action."""
    if job.parent is None:
        return
    parent, action_id = job.parent
    spec = store.spec(parent, action_id) or {"id": action_id}
    if status == "completed":
        executor.record_outcome(store, parent, action_id, spec, "ok", result, None, trigger=True)
    else:
        executor.record_outcome(store, parent, action_id, spec, "error", None,
                                f"{job.kind} job {job.id} {status}: {error}", trigger=True)


def expire_deferred(store: Store, job_id: str, action_id: str) -> None:
    """A child-job action's timeout ran out: it ends `timeout` and its child is cancelled."""
    spec = store.spec(job_id, action_id)
    if spec is None or store.results(job_id, [action_id]):
        return  # the child ended in time (or the job expired)
    message = f"timed out after {spec['timeout']:g}s; its child job was cancelled"
    # the child first (its end does not record the action: the timeout does), since
    # recording the timeout may end the parent, which would cancel the child for that reason
    cancel_job(store, child_job_id(job_id, action_id), reason=f"the action {action_id!r} of job "
               f"{job_id} that started it timed out", notify=False)
    executor.record_outcome(store, job_id, action_id, spec, "timeout", None, message)


def decide_approval(store: Store, job_id: str, action_id: str, *, approve: bool,
                    by: str, reason: str | None = None) -> str:
    """Answer an action's approval request (once): approved, it is sent; rejected, it fails
    with the reason, which the model reads as its error. Returns "approved" or "rejected" when
    this call decided, else what stood in the way: "was_approved" or "was_rejected", "none"
    (nothing was requested) or "ended" (the job)."""
    request = store.approvals(job_id).get(action_id)
    if request is not None and request.get("client"):
        if approve:
            return "none"  # the client answers its call with a result (`answer_client_call`)
        if store.action_status(job_id, action_id) != approvals.AWAITING:
            return "was_answered"  # its result is recorded: nothing left to reject
    decision = "approved" if approve else "rejected"
    event = {"action_id": action_id, "by": by, "reason": reason}
    outcome = store.decide_approval(job_id, action_id, decision, event)
    spec = store.spec(job_id, action_id)
    if outcome != decision or spec is None:
        return outcome
    if approve:
        dispatch.send(job_id, [spec])
    else:
        executor.record_outcome(store, job_id, action_id, spec, "error", None,
                                f"rejected by {by}: {reason or 'no reason given'}")
    return outcome


def answer_client_call(store: Store, job_id: str, action_id: str, result: Any,
                       error: str | None = None) -> str:
    """Record a client's answer to a call of one of the job's client tools as the action's
    outcome (once): `result`, or the `error` the client reports, which the model reads as
    the call's error; then the job goes on. Returns the status recorded ("ok", "error"), else
    what stood in the way: "none" (no such call awaits its client), "was_rejected" (it
    expired, or a person rejected it), "duplicate" (answered already) or "ended" (the job)."""
    request = store.approvals(job_id).get(action_id)
    spec = store.spec(job_id, action_id)
    if request is None or not request.get("client") or spec is None:
        return "none"
    if request["state"] != "requested":
        return f"was_{request['state']}"
    status = store.peek(job_id, "status")
    if status is None or status.ended:
        return "ended"
    if error is not None:
        return executor.record_outcome(store, job_id, action_id, spec, "error", None, error)
    return executor.record_outcome(store, job_id, action_id, spec, "ok", result, None)


class _Hooks:
    """What the executor asks of the job layer (see `executor.JobHooks`)."""

    def drained(self, store: Store, job_id: str) -> None:
        on_drained(store, job_id)

    def fail(self, store: Store, job_id: str, reason: str) -> None:
        cancel_job(store, job_id, status="failed", reason=reason)

    def start_child(self, store: Store, job_id: str, action_id: str, child: ChildJob) -> None:
        submit_child(store, job_id, action_id, child)


executor.install_job_hooks(_Hooks())
