"""Tools: specs (`kind: Tool` manifests), built-ins, and running a tool call.

from cortex_worker.tools import ToolContext, run_tool
result = run_tool(registry.tools["calculator"], {"expression": "6*7"}, ctx)
"""

from cortex_worker.tools.builtin import BUILTINS
from cortex_worker.tools.context import ToolContext, workspace_for
from cortex_worker.tools.errors import ToolError, ToolTimeout
from cortex_worker.tools.runtime import run_tool
from cortex_worker.tools.spec import Limits, ToolSpec, queue_for, validate_parameters

__all__ = [
    "BUILTINS",
    "Limits",
    "ToolContext",
    "ToolError",
    "ToolSpec",
    "ToolTimeout",
    "queue_for",
    "run_tool",
    "validate_parameters",
    "workspace_for",
]
