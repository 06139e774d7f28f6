"""`type="workflow"` actions: run a workflow as a child job of the action's job."""

from __future__ import annotations

from typing import Any

from cortex_worker.actions.call import Call, Deferred
from cortex_worker.errors import SubmitError
from cortex_worker.jobs import submit_workflow
from cortex_worker.options import JobOptions
from cortex_worker.runtime import get_store
from cortex_worker.store import job_keys
from cortex_worker.tools.errors import ToolError

__all__ = ["MAX_DEPTH", "run_workflow_action"]

MAX_DEPTH = 8
"""How deep jobs may nest under workflow actions (a workflow job's depth is its parent's + 1)."""


def run_workflow_action(call: Call) -> Any:
    """Start the child workflow job (once: its id is derived from this job and action) and
    defer: the child's end completes or fails this action with the workflow's output."""
    name = call.spec["name"]
    depth = int(call.spec.get("depth") or 0) + 1
    if depth > MAX_DEPTH:
        raise ToolError(f"workflow {name!r}: nesting depth limit ({MAX_DEPTH}) reached")
    store = get_store()
    options = store.redis.hget(job_keys(call.job_id)[0], "options")  # the child inherits them
    try:
        submit_workflow(store, name, call.params if call.params is not None else {},
                        options=JobOptions.model_validate_json(options or "{}"),
                        parent=(call.job_id, call.action_id), depth=depth)
    except SubmitError as exc:
        raise ToolError(exc.message) from None
    raise Deferred
