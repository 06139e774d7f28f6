"""`type="tool"`: a registered tool (`kind: Tool`, a `@tool` function or an MCP server's), or
one of the job's client tools (`JobOptions.client_tools`: held for the client's answer, never
sent to a pool; `jobs.approvals`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cortex_worker.actions.types.base import (
    ActionType,
    Agent,
    Callee,
    ClientTool,
    Problem,
    Tables,
    Target,
)
from cortex_worker.agents.text import compact, one_line
from cortex_worker.tools.errors import ToolError
from cortex_worker.tools.spec import queue_for, validate_parameters


def check(target: Target) -> list[Problem]:
    tool = target.registry.tools.get(target.name)
    if tool is None:
        return target.unknown("tool", target.registry.tools)
    if target.literal:
        try:
            validate_parameters(tool, target.parameters)
        except ToolError as exc:
            return [("invalid_parameters",
                     target.word(target.wording.tool_parameters, detail=str(exc)))]
    return []


def queue(registry: Tables, name: str) -> str:
    tool = registry.tools.get(name)
    return queue_for(tool) if tool is not None else "tool"


def timeout(registry: Tables, name: str) -> float | None:
    tool = registry.tools.get(name)
    return float(tool.timeout) if tool is not None and tool.timeout else None


def concurrency(registry: Tables, name: str) -> int | None:
    tool = registry.tools.get(name)
    return tool.max_concurrency if tool is not None else None


def approval(registry: Tables, name: str) -> bool:
    tool = registry.tools.get(name)
    return tool is not None and tool.require_approval


def grant(agent: Agent, name: str) -> str | None:
    """A job with client tools runs its agent with their names added to `tools`
    (`turns.loop`): they are granted like the manifest's own."""
    if name in agent.tools:
        return None
    return f"tool {name!r} is not available to agent {agent.name!r} (it may use: " \
           f"{', '.join(agent.tools) or 'no tools'})"


def prompt(agent: Agent, registry: Tables) -> str:
    return section(agent, registry, ())


def section(agent: Agent, registry: Tables, client: Sequence[ClientTool]) -> str:
    """The prompt's tool section: the agent's tools, then the job's client tools (called the
    same way: the model need not know who runs them)."""
    if not agent.tools and not client:
        return '# Tools (type="tool")\n\nNone: do not write type="tool" actions.'
    lines = ['# Tools (type="tool")', ""]
    native = agent.model.native_tools
    if native:  # their schemas are in the function definitions: not twice
        lines += ["Call them as native function calls, or as actions with the parameters of "
                  "their function definitions.", ""]
    listed = [(spec.name, spec.description, spec.parameters)
              for spec in (registry.tools[name] for name in agent.tools)]
    listed += [(tool.name, tool.description, tool.parameters) for tool in client]
    for name, text, parameters in listed:
        description = one_line(text)
        lines.append(f"- {name}" + (f": {description}" if description else ""))
        if not native:
            lines.append(f"  parameters: {compact(parameters)}")
    return "\n".join(lines)


def callees(agent: Agent, registry: Tables) -> Iterable[Callee]:
    for name in agent.tools:
        tool = registry.tools.get(name)
        if tool is None:
            raise LookupError(f"agent {agent.name!r} lists tool {name!r}, which is not registered")
        yield name, tool.parameters


def client_target(registry: Tables, name: str) -> bool:
    return name not in registry.tools


TYPE = ActionType("tool", check, "cortex_worker.tools.action:run_tool_action", queue,
                  grant=grant, prompt=prompt, callees=callees, timeout=timeout,
                  concurrency=concurrency, approval=approval, keyed=True, feed_source=True,
                  workflow_step=True, client_prompt=section, client_target=client_target)
