"""`type="workflow"`: a workflow (`kind: Workflow`), run as a child job; its inputs are the
action's parameters and its output the result."""

from __future__ import annotations

from collections.abc import Iterable

from cortex_worker.actions.types.base import (
    ActionType,
    Agent,
    Callee,
    Problem,
    Tables,
    Target,
    listing,
    on,
)


def check(target: Target) -> list[Problem]:
    flow = target.registry.workflows.get(target.name)
    if flow is None:
        return target.unknown("workflow", target.registry.workflows)
    if target.literal:
        bad = flow.input_errors(flow.prepare_inputs(target.parameters))
        if bad:
            return [("invalid_parameters",
                     target.word(target.wording.workflow_inputs, detail=bad[0][1]))]
    return []


def grant(agent: Agent, name: str) -> str | None:
    return None if name in agent.workflows else \
        f"workflow {name!r} is not available to agent {agent.name!r}"


def prompt(agent: Agent, registry: Tables) -> str | None:
    return listing('# Workflows (type="workflow")', agent.workflows)


def callees(agent: Agent, registry: Tables) -> Iterable[Callee]:
    for name in agent.workflows:
        flow = registry.workflows.get(name)
        if flow is None:
            raise LookupError(
                f"agent {agent.name!r} lists workflow {name!r}, which is not registered")
        yield name, flow.inputs


# A workflow's run is a child job: the agent pool asks for it and its end completes the action.
TYPE = ActionType("workflow", check, "cortex_worker.workflows.action:run_workflow_action",
                  on("agent"), grant=grant, prompt=prompt, callees=callees, keyed=True,
                  feed_source=True, workflow_step=True, child_job=True)
