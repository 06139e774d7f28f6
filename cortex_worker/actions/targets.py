"""The runners of tool, llm, agent and internal actions (named by `actions.table`).

A runner takes a `Call` and returns the action's value, or raises `ToolError` (a clean
failure), `ToolTimeout`, `ModelError`, or `Deferred` (a child job will record the outcome).
"""

from __future__ import annotations

import json
from typing import Any

from cortex_worker.actions.call import Call, ChildJob, Deferred
from cortex_worker.handles import get_registry
from cortex_worker.llm.config import ModelConfig
from cortex_worker.llm.gateway import complete
from cortex_worker.store.state import dumps
from cortex_worker.tools.context import ToolContext, workspace_for
from cortex_worker.tools.errors import ToolError
from cortex_worker.tools.runtime import run_tool


def run_tool_action(call: Call) -> Any:
    tool = get_registry().tools.get(call.spec["name"])
    if tool is None:
        raise ToolError(f"no tool named {call.spec['name']!r} is registered")
    ctx = ToolContext(job_id=call.job_id, action_id=call.action_id,
                      workspace=workspace_for(call.settings, call.job_id), timeout=call.timeout,
                      settings=call.settings)
    return run_tool(tool, call.params, ctx, module_paths=[call.settings.manifests])


def run_llm_action(call: Call) -> Any:
    """One completion whose prompt is the task and its parameters."""
    if not call.spec.get("model"):
        raise ToolError("llm actions run with an agent's model; this job has none")
    model = ModelConfig.model_validate(call.spec["model"])
    params = call.params
    prompt = params["prompt"] if isinstance(params, dict) and set(params) == {"prompt"} \
        else dumps(params)
    text, _ = complete(model, [
        {"role": "system", "content": f"You perform one task: {call.spec['name']}. "
                                      "Answer with its result only, without preamble."},
        {"role": "user", "content": prompt}], base_dir=call.settings.manifests)
    try:
        return json.loads(text)
    except ValueError:
        return text


def run_agent_action(call: Call) -> Any:
    """Ask for the child agent job; it completes this action when it ends."""
    params = call.params
    text = params["input"] if isinstance(params, dict) and isinstance(params.get("input"), str) \
        else dumps(params)
    raise Deferred(ChildJob("agent", call.spec["name"], text))
