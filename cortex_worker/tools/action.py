"""`type="tool"` actions: run the registered tool in the job's workspace."""

from __future__ import annotations

from typing import Any

from cortex_worker.actions.call import Call
from cortex_worker.handles import get_registry
from cortex_worker.tools.context import ToolContext, workspace_for
from cortex_worker.tools.errors import ToolError
from cortex_worker.tools.runtime import run_tool


def run_tool_action(call: Call) -> Any:
    tool = get_registry().tools.get(call.spec["name"])
    if tool is None:
        raise ToolError(f"no tool named {call.spec['name']!r} is registered")
    ctx = ToolContext(job_id=call.job_id, action_id=call.action_id,
                      workspace=workspace_for(call.settings, call.job_id), timeout=call.timeout,
                      settings=call.settings, attempt=call.attempt)
    return run_tool(tool, call.params, ctx, module_paths=[call.settings.manifests])
