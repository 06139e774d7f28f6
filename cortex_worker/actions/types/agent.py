"""`type="agent"`: another agent, run as a child job whose final response is the result."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from cortex_worker.actions.types.base import ActionType, Agent, Callee, Problem, Tables, Target, on
from cortex_worker.agents.text import one_line

PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"input": {"type": "string", "minLength": 1}},
    "required": ["input"],
    "additionalProperties": False,
}
"""What an agent action takes (the prompt section tells models the same)."""


def check(target: Target) -> list[Problem]:
    if target.name in target.registry.agents:
        return []
    return target.unknown("agent", target.registry.agents)


def grant(agent: Agent, name: str) -> str | None:
    return None if name in agent.agents else \
        f"agent {name!r} is not available to agent {agent.name!r}"


def prompt(agent: Agent, registry: Tables) -> str | None:
    if not agent.agents:
        return None
    lines = [
        '# Agents (type="agent")',
        "",
        'Call one with `{"name": "<agent>", "parameters": {"input": "<what it should do>"}}`; '
        "its result is its final response.",
        "",
    ]
    for name in agent.agents:
        other = registry.agents.get(name)
        description = one_line(other.description) if other else ""
        lines.append(f"- {name}" + (f": {description}" if description else ""))
    return "\n".join(lines)


def callees(agent: Agent, registry: Tables) -> Iterable[Callee]:
    for name in agent.agents:
        if name not in registry.agents:
            raise LookupError(
                f"agent {agent.name!r} lists agent {name!r}, which is not registered")
        yield name, PARAMETERS


TYPE = ActionType("agent", check, "cortex_worker.agents.action:run_agent_action", on("agent"),
                  grant=grant, prompt=prompt, callees=callees, keyed=True, workflow_step=True,
                  child_job=True)
