"""The action-type table: one row per `type` (tool, llm, agent, relic, workflow, internal).

A row says how an action of that type is checked against the registry before a job runs, which
pool queue runs it, its default timeout, and which function runs it. Runners are named as
`module:function` and imported by the worker that first runs one, so the API process, which
only checks and routes, never imports tool, sandbox or model code. A new type is one row here
plus its runner module.

The checks serve two askers: `jobs.check_document` before a document runs, and
`workflows.link.link_workflow` once every manifest has loaded (a workflow's steps are actions
too). `Target.wording` says which one asks, so the same problem reads as a document error
(`no tool named 'x' (registered: …)`) or as a manifest error (`unknown tool 'x'; declare it
with kind: Tool (known tools: …)`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, Protocol

from cortex_worker.agents.spec import INTERNAL_ACTIONS
from cortex_worker.protocol.variables import find_references
from cortex_worker.services.relics.spec import check_relic_action
from cortex_worker.tools.errors import ToolError
from cortex_worker.tools.spec import queue_for, validate_parameters
from cortex_worker.workflows import spec as wf

if TYPE_CHECKING:
    from cortex_worker.agents.spec import AgentSpec
    from cortex_worker.llm.config import ModelConfig
    from cortex_worker.services.relics.spec import RelicSpec
    from cortex_worker.settings import Settings
    from cortex_worker.tools.spec import ToolSpec

#: A problem found by a check: (kind, message); the message starts with the action's label.
Problem = tuple[str, str]


class Tables(Protocol):
    """What the checks and routes read of the manifests: `manifests.Registry` is one, also while
    it loads. Named here, not imported, so that the manifests can check workflows through this
    table."""

    @property
    def tools(self) -> Mapping[str, ToolSpec]: ...

    @property
    def agents(self) -> Mapping[str, AgentSpec]: ...

    @property
    def workflows(self) -> Mapping[str, wf.WorkflowSpec]: ...

    @property
    def relics(self) -> Mapping[str, RelicSpec]: ...


@dataclass(frozen=True, slots=True)
class Wording:
    """How the checks word their problems for one asker (`str.format` templates).

    Fields: `label` (the action's), `name` (its target's), `what` (`tool`, `agent`,
    `workflow`), `kind` (`Tool`, …: the manifest kind that declares one), `known` (the names
    there are, sorted) and `detail` (what the validator said). A relic's problems are worded by
    the relic (`relics.spec.check_relic_action`) and read the same for both askers.
    """

    unknown: str
    unknown_internal: str
    tool_parameters: str
    workflow_inputs: str
    no_model: str


DOCUMENT = Wording(
    unknown="{label}: no {what} named {name!r} (registered: {known})",
    unknown_internal="{label}: no internal action {name!r} (one of: {known})",
    tool_parameters="{label} ({name}): {detail}",
    workflow_inputs="{label} (workflow {name}): {detail}",
    no_model="{label}: llm actions in documents need a model: set CORTEX_DOCUMENT_MODEL "
             "(llm {name!r} cannot run)",
)
"""A document's action, checked before the document runs (`jobs.check_document`)."""

MANIFEST = Wording(
    unknown="{label}: unknown {what} {name!r}; declare it with kind: {kind} "
            "(known {what}s: {known})",
    unknown_internal="{label}: unknown internal action {name!r} (one of: {known})",
    tool_parameters="{label}: tool {name!r}: {detail}",
    workflow_inputs="{label}: workflow {name!r}: {detail}",
    no_model="{label}: llm steps run on the workflow's model; give the workflow a `model`",
)
"""A workflow manifest's step, checked once every manifest has loaded (`link_workflow`)."""


@dataclass(frozen=True, slots=True)
class Target:
    """What a check looks at: the action (by its label), its target's name and parameters."""

    label: str  # e.g. "action 'fetch'", "steps[0] 'fetch'"
    name: str
    parameters: Any
    registry: Tables
    settings: Settings | None = None
    """A document's: its llm actions run on `document_model`."""
    wording: Wording = DOCUMENT
    """Who asks: how the problems read."""
    model: ModelConfig | None = None
    """The model of the job's llm actions when the job has its own (a workflow's `model`)."""

    @property
    def literal(self) -> bool:
        """The parameters hold no `$reference`, so they can be validated before the run."""
        return not find_references(self.parameters)

    @property
    def llm_model(self) -> ModelConfig | None:
        """The model an llm action would run on: the job's own, else the documents' one."""
        if self.model is not None:
            return self.model
        return self.settings.document_model if self.settings is not None else None

    def word(self, template: str, **fields: Any) -> str:
        """A template of `wording` filled in with this action's label and name."""
        return template.format(label=self.label, name=self.name, **fields)


@dataclass(frozen=True, slots=True)
class ActionType:
    """One row of the table."""

    name: str
    queue: Callable[[Tables, str], str]  # the pool queue that runs an action on `name`
    check: Callable[[Target], list[Problem]]  # problems that stop a job from starting
    runner: str  # "module:function" taking a `Call`
    timeout: Callable[[Tables, str], float | None] = lambda registry, name: None
    #: how many actions on `name` may run at once across the cluster (None: no limit)
    concurrency: Callable[[Tables, str], int | None] = lambda registry, name: None


def _unknown(what: str, known: Mapping[str, Any], target: Target) -> list[Problem]:
    names = ", ".join(sorted(known)) or "none"
    return [(f"unknown_{what}", target.word(target.wording.unknown, what=what,
                                            kind=what.capitalize(), known=names))]


def _check_tool(target: Target) -> list[Problem]:
    tool = target.registry.tools.get(target.name)
    if tool is None:
        return _unknown("tool", target.registry.tools, target)
    if target.literal:
        try:
            validate_parameters(tool, target.parameters)
        except ToolError as exc:
            return [("invalid_parameters",
                     target.word(target.wording.tool_parameters, detail=str(exc)))]
    return []


def _check_agent(target: Target) -> list[Problem]:
    if target.name in target.registry.agents:
        return []
    return _unknown("agent", target.registry.agents, target)


def _check_workflow(target: Target) -> list[Problem]:
    flow = target.registry.workflows.get(target.name)
    if flow is None:
        return _unknown("workflow", target.registry.workflows, target)
    if target.literal:
        bad = wf.input_errors(flow, wf.prepare_inputs(flow, target.parameters))
        if bad:
            return [("invalid_parameters",
                     target.word(target.wording.workflow_inputs, detail=bad[0][1]))]
    return []


def _check_internal(target: Target) -> list[Problem]:
    if target.name in INTERNAL_ACTIONS:
        return []
    return [("unknown_internal_action", target.word(target.wording.unknown_internal,
                                                    known=", ".join(INTERNAL_ACTIONS)))]


def _check_relic(target: Target) -> list[Problem]:
    return [(kind, f"{target.label}: {message}") for kind, message
            in check_relic_action(target.registry.relics, target.name, target.parameters)]


def _check_llm(target: Target) -> list[Problem]:
    if target.llm_model is not None:
        return []
    return [("unsupported_action", target.word(target.wording.no_model))]


def _tool_queue(registry: Tables, name: str) -> str:
    tool = registry.tools.get(name)
    return queue_for(tool) if tool is not None else "tool"


def _tool_timeout(registry: Tables, name: str) -> float | None:
    tool = registry.tools.get(name)
    return float(tool.timeout) if tool is not None and tool.timeout else None


def _tool_concurrency(registry: Tables, name: str) -> int | None:
    tool = registry.tools.get(name)
    return tool.max_concurrency if tool is not None else None


def _on(queue: str) -> Callable[[Tables, str], str]:
    return lambda registry, name: queue


ACTION_TYPES: dict[str, ActionType] = {row.name: row for row in (
    ActionType("tool", _tool_queue, _check_tool, "cortex_worker.actions.targets:run_tool_action",
               _tool_timeout, _tool_concurrency),
    ActionType("llm", _on("llm"), _check_llm, "cortex_worker.actions.targets:run_llm_action"),
    ActionType("agent", _on("agent"), _check_agent, "cortex_worker.actions.targets:run_agent_action"),
    ActionType("relic", _on("relic"), _check_relic,
               "cortex_worker.services.relics.action:run_relic_action"),
    ActionType("workflow", _on("agent"), _check_workflow,
               "cortex_worker.workflows.action:run_workflow_action"),
    ActionType("internal", _on("agent"), _check_internal,
               "cortex_worker.jobs.internal:run_internal_action"),
)}


def queue_of(registry: Tables, spec: Mapping[str, Any]) -> str:
    """The pool queue of an action spec."""
    return ACTION_TYPES[spec["type"]].queue(registry, spec["name"])


@cache
def runner_of(type_name: str) -> Callable[[Any], Any]:
    """The function that runs actions of this type (imported on first use)."""
    module, _, function = ACTION_TYPES[type_name].runner.partition(":")
    return getattr(importlib.import_module(module), function)
