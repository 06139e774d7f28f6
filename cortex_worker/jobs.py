"""Jobs: submit, start, finish and cancel; `end_job` is the one place any job ends.

The API calls `submit_*` and `cancel_job`; the `agent` pool runs `start_document` (documents
and workflows share `start_plan`) and the agent turns (`coordinator`); the worker that
finishes a job's last action calls `on_drained`, through the hooks this module installs in
the executor (the executor sits below the jobs and never imports them).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from cortex_worker import dispatch, executor
from cortex_worker.actions.table import ACTION_TYPES, Target
from cortex_worker.errors import SubmitError
from cortex_worker.options import JobOptions
from cortex_worker.plan.canvas import decompose
from cortex_worker.plan.dag import Plan
from cortex_worker.protocol import parser as p
from cortex_worker.protocol.actions import Action
from cortex_worker.protocol.document import Document, load_document
from cortex_worker.protocol.variables import find_references, render
from cortex_worker.runtime import get_registry
from cortex_worker.settings import Settings, get_settings
from cortex_worker.store import DEFAULT_TENANT, JOB_TERMINAL, Store, dumps
from cortex_worker.workflows import spec as wf
from cortex_worker.workflows.output import failure_message, output_names, render_output


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


def _tenant(store: Store, tenant: str | None, parent: tuple[str, str] | None) -> str:
    """A new job's tenant: its parent job's (a child never leaves it), else the caller's."""
    if parent:
        return (store.get_job(parent[0]) or {}).get("tenant") or DEFAULT_TENANT
    return tenant or DEFAULT_TENANT


def model_of_document(settings: Settings, options: JobOptions) -> dict[str, Any]:
    """The `model` field of a document job (its llm actions'): `document_model`, with the
    job option `model` as its model name."""
    model = settings.document_model
    if model is None:
        return {}
    return {"model": model.named(options.model).model_dump(mode="json")}


def submit_document(store: Store, text: str, *, options: JobOptions | None = None,
                    tenant: str | None = None) -> str:
    """Validate `text`, create its job and queue its start; returns the job id."""
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
    job_id = uuid.uuid4().hex
    store.create_job(job_id, {
        "kind": "document",
        "tenant": _tenant(store, tenant, None),
        "document": text,
        "options": options.model_dump(),
        "limit": str(options.max_parallel or settings.max_parallel_actions),
        "responses": [{"final": r["final"], "text": r["text"]} for r in doc.responses],
        **model_of_document(settings, options),
    }, settings.event_retention_s, [("job_queued", {"kind": "document", "actions": len(doc.actions)})])
    dispatch.start_job(job_id)
    return job_id


def submit_workflow(store: Store, name: str, inputs: Any, *, options: JobOptions | None = None,
                    parent: tuple[str, str] | None = None, depth: int = 0,
                    tenant: str | None = None) -> str:
    """Validate `inputs`, create the workflow's job and queue its start; returns the job id.

    The job's actions are the workflow's steps; its `inputs` variable is the inputs object (the
    schema's top-level defaults filled in). A child of an action (`parent`: job id, action id)
    gets an id derived from them, so a redelivered action finds its job instead of starting
    another one.
    """
    registry = get_registry()
    flow = registry.workflows.get(name)
    if flow is None:
        known = ", ".join(sorted(registry.workflows)) or "none"
        message = f"no workflow named {name!r} (registered: {known})"
        raise SubmitError(message, [_problem("unknown_workflow", message)])
    if isinstance(inputs, dict):
        inputs = wf.prepare_inputs(flow, inputs)
    problems = wf.input_errors(flow, inputs)
    if problems:
        errors = [{**_problem("invalid_inputs", f"workflow {name!r}: {text}"), "path": path}
                  for path, text in problems]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise SubmitError(errors[0]["message"] + more, errors)
    settings = get_settings()
    options = options or JobOptions()
    if parent:  # one child per parent action, even if its task is delivered twice
        job_id = child_job_id(*parent)
        existing = store.get_job(job_id)
        if existing is not None:
            if existing.get("status") == "queued":  # its start may never have been sent
                dispatch.start_job(job_id)
            return job_id
    else:
        job_id = uuid.uuid4().hex
    actions = flow.actions()
    fields: dict[str, Any] = {
        "kind": "workflow", "workflow": flow.name, "inputs": inputs,
        "tenant": _tenant(store, tenant, parent),
        "actions": [a.model_dump(mode="json") for a in actions],
        "output": {"template": flow.output, "default": flow.last_step},
        "options": options.model_dump(), "depth": str(depth),
        "limit": str(options.max_parallel or settings.max_parallel_actions),
    }
    if flow.model is not None:
        fields["model"] = flow.model.model_dump(mode="json")
    if parent:
        fields.update(parent_job=parent[0], parent_action=parent[1])
    store.create_job(job_id, fields, settings.event_retention_s, [(
        "job_queued", {"kind": "workflow", "workflow": flow.name, "steps": len(actions),
                       "parent_job": parent and parent[0], "parent_action": parent and parent[1],
                       "depth": depth})])
    store.set_variables(job_id, {wf.INPUTS: inputs})
    if parent and not _adopt(store, parent, job_id):
        return job_id
    dispatch.start_job(job_id)
    return job_id


def _adopt(store: Store, parent: tuple[str, str], child: str) -> bool:
    """Link a new child job to its parent. False if the parent has ended: the child is then
    cancelled here, since the parent's own cancel may have listed its children before this one
    was added (it adds before it looks; a parent ends before it lists)."""
    store.add_child(parent[0], child)
    store.emit(parent[0], [("child_job", {"action_id": parent[1], "job_id": child})], live=True)
    status = (store.get_job(parent[0]) or {}).get("status")
    if status is not None and status not in JOB_TERMINAL:
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


def start_document(store: Store, job_id: str) -> None:
    """Run a queued document or workflow job: log its start, seed its variables, dispatch
    what is ready (see `start_plan`)."""
    job = store.get_job(job_id)
    if job is None or job["status"] not in ("queued", "running"):
        return
    if job.get("kind") == "workflow":  # its steps, stored as actions when it was submitted
        actions = [Action.model_validate(a) for a in json.loads(job.get("actions") or "[]")]
        plan, variables = wf.workflow_plan(actions), {}  # `inputs` was seeded at submit
        events = [("job_started", {"kind": "workflow", "workflow": job.get("workflow")}),
                  *[(p.ACTION_PARSED, {"action": a.model_dump(mode="json")}) for a in actions]]
    else:
        doc = load_document(job["document"])
        assert doc.plan is not None
        plan, variables = doc.plan, doc.feeds
        events = [("job_started", {"kind": "document"}), *_parse_events(doc)]
    start_plan(store, job_id, job, plan, events, variables)


def _inherited(job: dict[str, str], action: Action) -> dict[str, Any]:
    """Spec fields an action takes from its job: nesting depth, and llm actions' model."""
    extra: dict[str, Any] = {}
    if job.get("depth"):
        extra["depth"] = int(job["depth"])
    if action.type.value == "llm" and job.get("model"):
        extra["model"] = json.loads(job["model"])
    return extra


def start_plan(store: Store, job_id: str, job: dict[str, str], plan: Plan,
               events: list[tuple[str, dict[str, Any]]], variables: dict[str, Any]) -> None:
    """Start a job whose whole plan is known (a document, a workflow): log `events`, seed
    `variables`, register every action, and dispatch: one canvas mirroring a series-parallel
    plan, otherwise each action when it is ready."""
    options = JobOptions.model_validate_json(job.get("options") or "{}")
    store.set_variables(job_id, variables)  # first: a start redelivered later finds them
    begun = store.begin(job_id, events)  # atomic: a job cancelled meanwhile stays cancelled
    if begun == "ended":
        return
    redelivered = begun == "running"  # a worker died while starting it
    step = None
    if options.canvas if options.canvas is not None else get_settings().canvas:
        step = decompose(plan)
        if step is not None and step.width() > int(job.get("limit") or 1):
            step = None
    store.set_job(job_id, dispatch="canvas" if step else "readiness")
    entries = [action_entry(plan, a, _inherited(job, plan.nodes[a].action)) for a in plan.nodes]
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


def _parse_events(doc: Document) -> list[tuple[str, dict[str, Any]]]:
    """The document's parse as log events (chunks joined); responses end when rendered."""
    out: list[tuple[str, dict[str, Any]]] = []
    for event in p.coalesce(doc.events):
        if event.type == p.RESPONSE_END:
            continue
        data = event.data
        if event.type == p.ACTION_PARSED:
            data = {"action": data["action"].model_dump(mode="json"), "end": data["end"]}
        out.append((event.type, data))
    return out


def submit_agent(store: Store, agent: str, text: str, *, options: JobOptions | None = None,
                 parent: tuple[str, str] | None = None, depth: int = 0,
                 history: list[dict[str, Any]] | None = None, session: str | None = None,
                 tenant: str | None = None) -> str:
    """Create an agent job (`agent` must be registered) and queue its first turn."""
    spec = get_registry().agent(agent)
    settings = get_settings()
    options = options or JobOptions()
    if parent:  # one child per parent action, even if its task is delivered twice
        job_id = child_job_id(*parent)
        if store.get_job(job_id) is not None:
            return job_id
    else:
        job_id = uuid.uuid4().hex
    fields: dict[str, Any] = {
        "kind": "agent", "agent": spec.name, "input": text, "options": options.model_dump(),
        "tenant": _tenant(store, tenant, parent),
        "limit": str(options.max_parallel or settings.max_parallel_actions), "depth": str(depth),
        "final": "0", "reminders": "0",
    }
    if parent:
        fields.update(parent_job=parent[0], parent_action=parent[1])
    if session:
        fields["session"] = session
    store.create_job(job_id, fields, settings.event_retention_s, [(
        "job_queued", {"kind": "agent", "agent": spec.name, "parent_job": parent and parent[0],
                       "parent_action": parent and parent[1], "depth": depth})])
    if history:
        store.append_conversation(job_id, *history)
    if parent and not _adopt(store, parent, job_id):
        return job_id
    periodic = {f.id: f for f in spec.context_feeds if f.type == "periodic" and f.enabled}
    if periodic:
        dispatch.refresh_feeds(job_id, periodic)
    dispatch.agent_turn(job_id)
    return job_id


def on_drained(store: Store, job_id: str) -> None:
    """Nothing is left to wait for: a document job ends, an agent job takes its next turn."""
    job = store.get_job(job_id)
    if job is None or job.get("status") != "finishing":
        return
    if job.get("kind") == "agent":
        dispatch.agent_turn(job_id)
    else:
        finalize(store, job_id)


def child_job_id(parent_job: str, parent_action: str) -> str:
    """The id of the one child job an agent or workflow action starts (stable on redelivery)."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"cortex:{parent_job}:{parent_action}").hex


def render_responses(store: Store, job_id: str, responses: list[dict[str, Any]]
                     ) -> tuple[list[tuple[str, dict[str, Any]]], str | None]:
    """`response_end` events with the job's variables filled in, and the last final text."""
    names = {ref for r in responses for ref in find_references(r["text"])}
    values = store.variables(job_id, names)
    events: list[tuple[str, dict[str, Any]]] = []
    final = None
    for response in responses:
        text, _ = render(response["text"], values)
        events.append(("response_end", {"final": response["final"], "text": text}))
        if response["final"]:
            final = text
    return events, final


def finalize(store: Store, job_id: str) -> None:
    """End a drained job: render its responses (a workflow: its output), record its outcome
    (once), and hand it to the action that started the job, if one did."""
    job = store.get_job(job_id)
    if job is None or job.get("status") != "finishing":
        return
    failures = int(job.get("failures") or 0)
    status = "failed" if failures else "completed"
    events: list[tuple[str, dict[str, Any]]] = []
    result: Any = None
    if job.get("kind") == "workflow":
        result, error, events = _workflow_end(store, job_id, job, failures)
    else:
        events, result = render_responses(store, job_id, json.loads(job.get("responses") or "[]"))
        error = f"{failures} action(s) failed" if failures else ""
    started = float(job.get("started_at") or job["created_at"])
    summary = {"status": status, "result": result, "error": error or None,
               "duration_ms": round((time.time() - started) * 1000, 3)}
    text = "" if result is None else result if isinstance(result, str) else dumps(result)
    end_job(store, job_id, status, summary, {"result": text, "error": error}, events=events,
            only_if="finishing", result=result)


def _workflow_end(store: Store, job_id: str, job: dict[str, str],
                  failures: int) -> tuple[Any, str, list[tuple[str, dict[str, Any]]]]:
    """A drained workflow run: (its output rendered from the job's variables, "", warnings),
    or (None, which steps failed and why, []) if any step failed."""
    name = job.get("workflow") or "?"
    if failures:
        return None, failure_message(name, store.actions(job_id)), []
    output = json.loads(job.get("output") or "{}")
    template, default = output.get("template"), output.get("default") or ""
    values = store.variables(job_id, output_names(template, default))
    result, unresolved = render_output(template, default, values)
    warnings = [("warning", {"kind": "unresolved_reference", "message": f"{u.text} in the "
                             f"output of workflow {name!r} was left as written: {u.reason}"})
                for u in unresolved]
    return result, "", warnings


def end_job(store: Store, job_id: str, status: str, data: dict[str, Any],
            fields: dict[str, Any], *, events: Sequence[tuple[str, dict[str, Any]]] = (),
            only_if: str = "", result: Any = None) -> bool:
    """The one place a job ends, whatever its kind: log `events` and `job_<status>` (`data`),
    cancel what is unfinished (unless it completed), revoke what runs, cancel its children,
    and hand the outcome (`result`, or `data["error"]`) to the action that started it. False
    if it had already ended (or was not `only_if`)."""
    kind = {"completed": "job_completed", "cancelled": "job_cancelled"}.get(status, "job_failed")
    ended = store.close(job_id, status, fields, [*events, (kind, data)], only_if=only_if)
    if ended is None:
        return False
    dispatch.revoke(job_id, ended)
    if status != "completed":
        cancel_children(store, job_id)
    job = store.get_job(job_id) or {}
    _notify_parent(store, job, status, result, data.get("error") or data.get("reason"))
    return True


def cancel_job(store: Store, job_id: str, *, status: str = "cancelled",
               reason: str = "cancelled by request") -> bool:
    """End a job now (cancel, or `failed` for fail_fast). False if it had already ended."""
    return end_job(store, job_id, status, {"status": status, "reason": reason}, {"error": reason})


def cancel_children(store: Store, job_id: str) -> None:
    """Cancel the child jobs (agent and workflow actions) of a job that ended early."""
    for child in store.children(job_id):
        cancel_job(store, child, reason=f"its parent job {job_id} ended")


def _notify_parent(store: Store, job: dict[str, str], status: str, result: Any,
                   error: str | None) -> None:
    """A child job ended: its outcome completes or fails the parent's action."""
    parent, action_id = job.get("parent_job"), job.get("parent_action")
    if not parent or not action_id:
        return
    spec = store.spec(parent, action_id) or {"id": action_id}
    if status == "completed":
        executor.record_outcome(store, parent, action_id, spec, "ok", result, None, trigger=True)
    else:
        executor.record_outcome(store, parent, action_id, spec, "error", None,
                                f"{job.get('kind') or 'child'} job {job.get('id')} {status}: "
                                f"{error}", trigger=True)


def expire_deferred(store: Store, job_id: str, action_id: str) -> None:
    """A child-job action's timeout ran out: it ends `timeout` and its child is cancelled."""
    spec = store.spec(job_id, action_id)
    if spec is None or store.results(job_id, [action_id]):
        return  # the child ended in time (or the job expired)
    message = f"timed out after {spec['timeout']:g}s; its child job was cancelled"
    executor.record_outcome(store, job_id, action_id, spec, "timeout", None, message)
    cancel_job(store, child_job_id(job_id, action_id), reason=f"the action {action_id!r} of job "
               f"{job_id} that started it timed out")


class _Hooks:
    """What the executor asks of the job layer (see `executor.JobHooks`)."""

    def drained(self, store: Store, job_id: str) -> None:
        on_drained(store, job_id)

    def fail(self, store: Store, job_id: str, reason: str) -> None:
        cancel_job(store, job_id, status="failed", reason=reason)


executor.install_job_hooks(_Hooks())
