"""`type="agent"`: another agent. A local one (`kind: Agent`) runs as a child job whose final
response is the result; a remote one (`kind: RemoteAgent`) is called over A2A from the `llm`
pool (threaded: the call waits on the network, and holds no agent-pool slot meanwhile)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from cortex_worker.actions.types.base import ActionType, Agent, Callee, Problem, Tables, Target
from cortex_worker.agents.text import one_line

PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"input": {"type": "string", "minLength": 1}},
    "required": ["input"],
    "additionalProperties": False,
}
"""What an agent action takes (the prompt section tells models the same)."""


def known(registry: Tables) -> Mapping[str, Any]:
    """Every agent an action may name: the local ones, then the remote ones."""
    return {**registry.remote_agents, **registry.agents}


def check(target: Target) -> list[Problem]:
    agents = known(target.registry)
    return [] if target.name in agents else target.unknown("agent", agents)


def queue(registry: Tables, name: str) -> str:
    return "llm" if name not in registry.agents and name in registry.remote_agents else "agent"


def timeout(registry: Tables, name: str) -> float | None:
    remote = None if name in registry.agents else registry.remote_agents.get(name)
    return remote.timeout_s if remote is not None else None


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
    agents = known(registry)
    for name in agent.agents:
        other = agents.get(name)
        description = one_line(other.description) if other else ""
        lines.append(f"- {name}" + (f": {description}" if description else ""))
    return "\n".join(lines)


def callees(agent: Agent, registry: Tables) -> Iterable[Callee]:
    agents = known(registry)
    for name in agent.agents:
        if name not in agents:
            raise LookupError(
                f"agent {agent.name!r} lists agent {name!r}, which is not registered")
        yield name, PARAMETERS


TYPE = ActionType("agent", check, "cortex_worker.agents.remote:run_agent_action", queue,
                  grant=grant, prompt=prompt, callees=callees, timeout=timeout, keyed=True,
                  workflow_step=True, child_job=True)
