"""A workflow's steps against every manifest loaded (`manifests` runs this once all have).

Each step is checked as an action of its type, through the action-type table
(`actions.table.ACTION_TYPES`), as a document's actions are before they run, worded as a
manifest error (`table.MANIFEST`). What only workflows can get wrong is checked here: a
workflow step that runs its own workflow, and workflows that call each other in a circle.
"""

from __future__ import annotations

from collections.abc import Mapping

from cortex_worker.actions.table import ACTION_TYPES, MANIFEST, Tables, Target
from cortex_worker.workflows.spec import WorkflowSpec, step_label

__all__ = ["link_workflow"]


def _workflow_loop(name: str, workflows: Mapping[str, WorkflowSpec],
                   start: str) -> list[str] | None:
    """A chain of workflow steps from `name` back to `start`, if there is one."""
    stack: list[tuple[str, list[str]]] = [(name, [start, name])]
    seen: set[str] = set()
    while stack:
        current, path = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        spec = workflows.get(current)
        if spec is None:
            continue
        for step in spec.steps:
            if step.type != "workflow":
                continue
            if step.name == start:
                return [*path, start]
            stack.append((step.name, [*path, step.name]))
    return None


def link_workflow(spec: WorkflowSpec, registry: Tables) -> None:
    """Check what the steps name against the manifests: ValueError (field path first)."""
    for index, step in enumerate(spec.steps):
        label = step_label(index, step)
        if step.type == "workflow":  # a child job: it must not lead back to this workflow
            if step.name == spec.name:
                raise ValueError(f"{label}: a workflow cannot run itself")
            loop = _workflow_loop(step.name, registry.workflows, spec.name)
            if loop:
                raise ValueError(f"{label}: workflows call each other in a circle: "
                                 + " -> ".join(loop))
        target = Target(label, step.name, step.parameters, registry, wording=MANIFEST,
                        model=spec.model)
        problems = ACTION_TYPES[step.type].check(target)
        if problems:
            raise ValueError(problems[0][1])
