"""`type="workflow"` actions: run a workflow as a child job of the action's job."""

from __future__ import annotations

from typing import Any

from cortex_worker.actions.call import Call, ChildJob, Deferred

__all__ = ["run_workflow_action"]


def run_workflow_action(call: Call) -> Any:
    """Ask for the child workflow job (its inputs: the parameters); its end completes or
    fails this action with the workflow's output."""
    raise Deferred(ChildJob("workflow", call.spec["name"],
                            call.params if call.params is not None else {}))
