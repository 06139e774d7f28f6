"""`kind: Workflow` manifests: named steps with dependencies and inputs (docs/workflows.md).

A workflow's steps are protocol actions: `actions()` builds them with `build_action` (every step
is `async`, so only dependencies order them) and `plan()` plans them with `build_plan`, exactly as
a document's actions are, with `inputs` as a variable known from the start. Implicit dependencies
therefore come from `$step` / `${step.path}` references in parameters.

`check_workflow` sees one manifest alone (ids, references, cycles, the inputs schema);
`workflows.link.link_workflow` runs once every manifest has loaded (the tools, agents, relics
and workflows the steps name exist, checked through the action-type table; workflows do not
call each other in a circle).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError as SchemaValidationError
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from cortex_worker.actions.table import ACTION_TYPES, WORKFLOW_STEPS
from cortex_worker.llm.config import ModelField
from cortex_worker.plan.dag import Plan, build_plan
from cortex_worker.protocol.actions import Action, ActionError, build_action, parse_depends_on
from cortex_worker.protocol.variables import iter_references
from cortex_worker.tools.spec import check_name, check_object_schema

__all__ = [
    "INPUTS",
    "WorkflowSpec",
    "WorkflowStep",
    "check_workflow",
    "step_label",
    "workflow_plan",
]

INPUTS = "inputs"
"""The variable that holds a run's inputs object (`$inputs.field`)."""

IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$", re.ASCII)
StepType = Literal[WORKFLOW_STEPS]
"""The action types a step may be (`actions.table`)."""


class WorkflowStep(BaseModel):
    """One step: an action of the workflow (`type` and `name` say what it runs)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(description="unique in the workflow; `$id` is the step's value")
    type: StepType = "tool"
    name: str = Field(min_length=1, description="the tool, agent, relic, workflow or llm task")
    parameters: dict[str, Any] = Field(default_factory=dict,
                                       description="may reference $inputs and other steps")
    depends_on: list[str] = Field(default_factory=list,
                                  description="explicit dependencies (references add the rest)")
    timeout: float | None = Field(default=None, gt=0, description="seconds")
    retry: int = Field(default=0, ge=0, le=100)
    on_error: Literal["fail", "continue"] = "fail"
    output_key: str | None = Field(default=None, description="another name for the value")

    @field_validator("id", "output_key")
    @classmethod
    def _identifier(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not IDENT.match(value):
            raise ValueError(f"{value!r} is not a valid name: use letters, digits and '_', not "
                             "starting with a digit (it is referenced as $name)")
        if value == INPUTS:
            raise ValueError(f"{INPUTS!r} is reserved for the workflow's inputs ($inputs)")
        return value

    @field_validator("depends_on", mode="before")
    @classmethod
    def _depends_on(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return parse_depends_on(value)
            except ActionError as exc:
                raise ValueError(exc.message) from None
        return value


class WorkflowSpec(BaseModel):
    """A named DAG of steps run as one job; `output` is what the job returns."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["Workflow"] = "Workflow"
    name: str = Field(description="letters, digits, _ . -; at most 64")
    description: str = ""
    inputs: dict[str, Any] = Field(default_factory=lambda: {"type": "object"},
                                   description="JSON Schema of the inputs object")
    steps: list[WorkflowStep] = Field(min_length=1)
    output: Any = Field(default=None, description="a $ expression, or an object / template "
                                                  "with $ references; default: the last step")
    model: ModelField | None = Field(
        default=None, description="the model of `llm` steps: an inline block, or the name of "
        "a `kind: Model` (a `ModelConfig` once the manifests are linked)")

    _validator: Draft202012Validator | None = PrivateAttr(default=None)
    _plan: Plan | None = PrivateAttr(default=None)

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        return check_name(name, "workflow")

    @field_validator("inputs")
    @classmethod
    def _inputs_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        return check_object_schema(schema, "inputs")

    # -- derived ------------------------------------------------------------------------
    @property
    def validator(self) -> Draft202012Validator:
        if self._validator is None:
            self._validator = Draft202012Validator(
                self.inputs, format_checker=Draft202012Validator.FORMAT_CHECKER)
        return self._validator

    def input_errors(self, inputs: Any) -> list[tuple[str, str]]:
        """Every problem of an inputs object as (path, message), e.g. ("inputs.x", "inputs.x: ...")."""
        if not isinstance(inputs, Mapping):
            return [(INPUTS, f"{INPUTS}: must be an object, got {type(inputs).__name__}")]
        errors = sorted(self.validator.iter_errors(dict(inputs)),
                        key=lambda e: [str(p) for p in e.absolute_path])
        return [(_where(e), f"{_where(e)}: {e.message}") for e in errors]

    def prepare_inputs(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """The inputs with the schema's top-level `default`s filled in for absent properties."""
        out = dict(inputs)
        for key, prop in (self.inputs.get("properties") or {}).items():
            if key not in out and isinstance(prop, Mapping) and "default" in prop:
                out[key] = prop["default"]
        return out

    @property
    def last_step(self) -> str:
        """The id of the last step declared: its value is the default output."""
        return self.steps[-1].id

    def actions(self) -> list[Action]:
        """The steps as protocol actions (all `async`; `line` is the step's position)."""
        return [step_action(step, index) for index, step in enumerate(self.steps)]

    def plan(self) -> Plan:
        """The steps' dependency graph, as `build_plan` makes it for a document."""
        if self._plan is None:
            self._plan = workflow_plan(self.actions())
        return self._plan


def step_action(step: WorkflowStep, index: int) -> Action:
    """One step as an `Action` (raises `ActionError` if it cannot be one)."""
    body = step.model_dump(exclude_none=True)
    body.update(mode="async", depends_on=list(step.depends_on))
    action, _ = build_action({}, body, default_id=step.id, line=index + 1, column=1)
    return action


def workflow_plan(actions: list[Action]) -> Plan:
    """The plan of a workflow's actions: `$inputs` is known from the start."""
    return build_plan(actions, known=[INPUTS])


# -- inputs -----------------------------------------------------------------------------
def _where(error: SchemaValidationError) -> str:
    text = INPUTS
    for part in error.absolute_path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text


# -- checks -----------------------------------------------------------------------------
def step_label(index: int, step: WorkflowStep) -> str:
    """How messages name a step: `steps[0] 'fetch'`."""
    return f"steps[{index}] {step.id!r}"


def _closed_inputs(spec: WorkflowSpec) -> set[str] | None:
    """The only input names allowed, when the schema forbids others; else None."""
    if spec.inputs.get("additionalProperties") is False:
        return set(spec.inputs.get("properties") or {})
    return None


def _check_references(value: Any, where: str, producers: Mapping[str, str],
                      allowed_inputs: set[str] | None, steps: str) -> str | None:
    strings: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            strings.append(item)
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    for text in strings:
        for ref in iter_references(text):
            if ref.name == INPUTS:
                if allowed_inputs is not None and ref.path and ref.path[0] not in allowed_inputs:
                    known = ", ".join(sorted(allowed_inputs)) or "none"
                    return (f"{where}: {ref.text} names no input (the inputs schema allows: "
                            f"{known})")
                continue
            if ref.name not in producers:
                return (f"{where}: {ref.text} names no step (steps: {steps}) and is not "
                        f"$inputs; write $$ for a literal '$'")
    return None


def check_workflow(spec: WorkflowSpec) -> str | None:
    """Rules one workflow must follow alone: an error message (field path first) or None."""
    producers: dict[str, str] = {}  # name -> the step that makes it
    ids: dict[str, int] = {}
    for index, step in enumerate(spec.steps):
        if step.id in ids:
            return f"steps[{index}].id: {step.id!r} is already the id of steps[{ids[step.id]}]"
        ids[step.id] = index
    for step in spec.steps:
        producers[step.id] = step.id
    for index, step in enumerate(spec.steps):
        key = step.output_key
        if key is not None and key != step.id:
            if key in producers:
                return (f"{step_label(index, step)}.output_key: {key!r} is already the id or "
                        f"output_key of step {producers[key]!r}")
            producers[key] = step.id
    steps = ", ".join(s.id for s in spec.steps)
    allowed_inputs = _closed_inputs(spec)
    for index, step in enumerate(spec.steps):
        for dep in step.depends_on:
            if dep not in ids:
                return f"{step_label(index, step)}.depends_on: unknown step {dep!r} (steps: {steps})"
        problem = _check_references(step.parameters, f"{step_label(index, step)}.parameters",
                                    producers, allowed_inputs, steps)
        if problem:
            return problem
        if ACTION_TYPES[step.type].needs_model and spec.model is None:
            return (f"{step_label(index, step)}: llm steps run on the workflow's model; give the "
                    "workflow a `model`")
    problem = _check_references(spec.output, "output", producers, allowed_inputs, steps)
    if problem:
        return problem
    try:
        plan = spec.plan()
    except ActionError as exc:  # the step model already rules out what build_action rejects
        return f"steps: {exc.message}"
    for issue in plan.errors:
        index = ids.get(issue.action_id or "", 0)
        return f"{step_label(index, spec.steps[index])}: {issue.message}"
    return None

