"""The action-type table: one row per `type` (tool, llm, agent, relic, workflow, internal).

A row says how an action of that type is checked against the registry before a job runs, which
pool queue runs it, its default timeout, and which function runs it. Runners are named as
`module:function` and imported by the worker that first runs one, so the API process, which
only checks and routes, never imports tool, sandbox or model code. A new type is one row here
plus its runner module.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from cortex_worker.agents.spec import INTERNAL_ACTIONS
from cortex_worker.protocol.variables import find_references
from cortex_worker.relics.spec import check_relic_action
from cortex_worker.tools.errors import ToolError
from cortex_worker.tools.spec import queue_for, validate_parameters
from cortex_worker.workflows import spec as wf

if TYPE_CHECKING:
    from cortex_worker.manifests import Registry
    from cortex_worker.settings import Settings

#: A problem found by a check: (kind, message); the message starts with the action's label.
Problem = tuple[str, str]


@dataclass(frozen=True, slots=True)
class Target:
    """What a check looks at: the action (by its label), its target's name and parameters."""

    label: str  # e.g. "action 'fetch'"
    name: str
    parameters: Any
    registry: Registry
    settings: Settings

    @property
    def literal(self) -> bool:
        """The parameters hold no `$reference`, so they can be validated before the run."""
        return not find_references(self.parameters)


@dataclass(frozen=True, slots=True)
class ActionType:
    """One row of the table."""

    name: str
    queue: Callable[[Registry, str], str]  # the pool queue that runs an action on `name`
    check: Callable[[Target], list[Problem]]  # problems that stop a job from starting
    runner: str  # "module:function" taking a `Call`
    timeout: Callable[[Registry, str], float | None] = lambda registry, name: None


def _unknown(kind: str, what: str, known: Mapping[str, Any] | tuple[str, ...], target: Target,
             ) -> list[Problem]:
    names = ", ".join(sorted(known)) or "none"
    return [(f"unknown_{kind}", f"{target.label}: no {what} named {target.name!r} "
                                f"(registered: {names})")]


def _check_tool(target: Target) -> list[Problem]:
    tool = target.registry.tools.get(target.name)
    if tool is None:
        return _unknown("tool", "tool", target.registry.tools, target)
    if target.literal:
        try:
            validate_parameters(tool, target.parameters)
        except ToolError as exc:
            return [("invalid_parameters", f"{target.label} ({target.name}): {exc}")]
    return []


def _check_agent(target: Target) -> list[Problem]:
    if target.name in target.registry.agents:
        return []
    return _unknown("agent", "agent", target.registry.agents, target)


def _check_workflow(target: Target) -> list[Problem]:
    flow = target.registry.workflows.get(target.name)
    if flow is None:
        return _unknown("workflow", "workflow", target.registry.workflows, target)
    if target.literal:
        bad = wf.input_errors(flow, wf.prepare_inputs(flow, target.parameters))
        if bad:
            return [("invalid_parameters", f"{target.label} (workflow {target.name}): {bad[0][1]}")]
    return []


def _check_internal(target: Target) -> list[Problem]:
    if target.name in INTERNAL_ACTIONS:
        return []
    return [("unknown_internal_action", f"{target.label}: no internal action {target.name!r} "
                                        f"(one of: {', '.join(INTERNAL_ACTIONS)})")]


def _check_relic(target: Target) -> list[Problem]:
    return [(kind, f"{target.label}: {message}") for kind, message
            in check_relic_action(target.registry.relics, target.name, target.parameters)]


def _check_llm(target: Target) -> list[Problem]:
    if target.settings.document_model is not None:
        return []
    return [("unsupported_action", f"{target.label}: llm actions in documents need a model: set "
                                   f"CORTEX_DOCUMENT_MODEL (llm {target.name!r} cannot run)")]


def _tool_queue(registry: Registry, name: str) -> str:
    tool = registry.tools.get(name)
    return queue_for(tool) if tool is not None else "tool"


def _tool_timeout(registry: Registry, name: str) -> float | None:
    tool = registry.tools.get(name)
    return float(tool.timeout) if tool is not None and tool.timeout else None


def _on(queue: str) -> Callable[[Registry, str], str]:
    return lambda registry, name: queue


ACTION_TYPES: dict[str, ActionType] = {row.name: row for row in (
    ActionType("tool", _tool_queue, _check_tool, "cortex_worker.targets:run_tool_action",
               _tool_timeout),
    ActionType("llm", _on("llm"), _check_llm, "cortex_worker.targets:run_llm_action"),
    ActionType("agent", _on("agent"), _check_agent, "cortex_worker.targets:run_agent_action"),
    ActionType("relic", _on("relic"), _check_relic,
               "cortex_worker.relics.runner:run_relic_action"),
    ActionType("workflow", _on("agent"), _check_workflow,
               "cortex_worker.workflows.runner:run_workflow_action"),
    ActionType("internal", _on("agent"), _check_internal,
               "cortex_worker.internal:run_internal_action"),
)}


def queue_of(registry: Registry, spec: Mapping[str, Any]) -> str:
    """The pool queue of an action spec."""
    return ACTION_TYPES[spec["type"]].queue(registry, spec["name"])


@cache
def runner_of(type_name: str) -> Callable[[Any], Any]:
    """The function that runs actions of this type (imported on first use)."""
    module, _, function = ACTION_TYPES[type_name].runner.partition(":")
    return getattr(importlib.import_module(module), function)
