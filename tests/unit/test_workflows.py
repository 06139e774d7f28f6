"""`kind: Workflow`: manifest checks, the plan and canvas of the steps, inputs, output, API."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, get_args

import pytest
from celery import Celery, group
from celery.canvas import _chain as chain
from celery.canvas import _chord as chord
from fastapi.testclient import TestClient
from pydantic import ValidationError

from cortex_api.app import create_app
from cortex_api.models import JobCreate
from cortex_api.routes.registry import registry_dep
from cortex_worker.actions.table import ACTION_TYPES, MANIFEST, Target
from cortex_worker.jobs import lifecycle as jobs
from cortex_worker.jobs.record import JobRecord, encode
from cortex_worker.llm.config import ModelConfig
from cortex_worker.manifests.loader import (
    UnknownWorkflowError,
    load_registry,
)
from cortex_worker.plan.canvas import decompose, to_canvas
from cortex_worker.protocol.document import load_document
from cortex_worker.settings import Settings
from cortex_worker.workflows import (
    WorkflowSpec,
    WorkflowStep,
    check_workflow,
    failure_message,
    render_output,
)
from tests.manifest_helpers import (
    EXAMPLE_MANIFESTS,
    REPO_ROOT,
    TEST_MANIFESTS,
    load_error,
    write,
)

pytestmark = pytest.mark.unit



def workflow_error(tmp_path: Path, text: str) -> str:
    write(tmp_path, "m/workflows.yaml", text)
    return load_error(tmp_path / "m")


@pytest.fixture(autouse=True)
def _chdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """File names in messages are relative to the current directory."""
    monkeypatch.chdir(tmp_path)


def flow(steps: list[dict[str, Any]], **fields: Any) -> WorkflowSpec:
    spec = WorkflowSpec.model_validate({"name": "w", "steps": steps, **fields})
    assert check_workflow(spec) is None, check_workflow(spec)
    return spec


def echo(ident: str, message: Any = "x", **extra: Any) -> dict[str, Any]:
    return {"id": ident, "name": "echo", "parameters": {"message": message}, **extra}


# ---------------------------------------------------------------- loading


def test_test_and_example_manifests_load() -> None:
    registry = load_registry(TEST_MANIFESTS)
    assert {"diamond", "failing", "nested", "main_workflow"} <= set(registry.workflows)
    diamond = registry.workflow("diamond")
    assert [s.id for s in diamond.steps] == ["double", "plus_one", "copy", "join"]
    assert registry.source("Workflow", "diamond").endswith("tests/manifests/workflows.yaml")
    assert "title_card" in load_registry(EXAMPLE_MANIFESTS).workflows


def test_unknown_workflow_lists_the_known_ones() -> None:
    registry = load_registry(TEST_MANIFESTS)
    with pytest.raises(UnknownWorkflowError, match=r"unknown workflow 'ghost'; known workflows: "
                                                   r"diamond, failing, main_workflow, nested, sleepy"):
        registry.workflow("ghost")


def test_a_single_kind_workflow_document(tmp_path: Path) -> None:
    write(tmp_path, "m/w.yaml", """\
        kind: Workflow
        name: one
        steps:
          - {id: a, name: echo, parameters: {message: hi}}
        """)
    spec = load_registry(tmp_path / "m").workflow("one")
    assert spec.inputs == {"type": "object"} and spec.output is None and spec.last_step == "a"


# ---------------------------------------------------------------- manifest errors


def test_cycle_names_its_members(tmp_path: Path) -> None:
    message = workflow_error(tmp_path, """\
        workflows:
          - name: loop
            steps:
              - {id: a, name: echo, parameters: {message: "$c"}}
              - {id: b, name: echo, parameters: {message: "$a"}}
              - {id: c, name: echo, parameters: {message: "${b.x}"}}
              - {id: d, name: echo, parameters: {message: "$c"}}
        """)
    assert message.startswith(
        "m/workflows.yaml: workflows[0] 'loop': steps[0] 'a': dependency cycle: a -> c -> b -> a"
    ), message
    assert "'d'" not in message and " d " not in message


def test_self_dependency_is_a_cycle(tmp_path: Path) -> None:
    message = workflow_error(tmp_path, """\
        kind: Workflow
        name: selfish
        steps:
          - {id: a, name: echo, depends_on: [a]}
        """)
    assert message == ("m/workflows.yaml: Workflow 'selfish': steps[0] 'a': dependency cycle: "
                       "a -> a")


def test_unknown_step_reference(tmp_path: Path) -> None:
    message = workflow_error(tmp_path, """\
        kind: Workflow
        name: typo
        steps:
          - {id: fetch, name: echo, parameters: {message: one}}
          - {id: use, name: echo, parameters: {message: "got ${fetched.text}"}}
        """)
    assert message == (
        "m/workflows.yaml: Workflow 'typo': steps[1] 'use'.parameters: ${fetched.text} names no "
        "step (steps: fetch, use) and is not $inputs; write $$ for a literal '$'")


def test_unknown_depends_on(tmp_path: Path) -> None:
    message = workflow_error(tmp_path, """\
        kind: Workflow
        name: typo
        steps:
          - {id: a, name: echo, depends_on: "b, zz"}
          - {id: b, name: echo}
        """)
    assert message.endswith("steps[0] 'a'.depends_on: unknown step 'zz' (steps: a, b)")


def test_unknown_reference_in_output(tmp_path: Path) -> None:
    message = workflow_error(tmp_path, """\
        kind: Workflow
        name: w
        steps: [{id: a, name: echo}]
        output: {value: "$b"}
        """)
    assert message.endswith("Workflow 'w': output: $b names no step (steps: a) and is not "
                            "$inputs; write $$ for a literal '$'")


def test_unknown_input_when_the_schema_is_closed(tmp_path: Path) -> None:
    message = workflow_error(tmp_path, """\
        kind: Workflow
        name: w
        inputs: {type: object, properties: {x: {type: integer}}, additionalProperties: false}
        steps: [{id: a, name: echo, parameters: {message: "$inputs.y"}}]
        """)
    assert message.endswith("steps[0] 'a'.parameters: $inputs.y names no input (the inputs "
                            "schema allows: x)")


def test_duplicate_step_ids(tmp_path: Path) -> None:
    message = workflow_error(tmp_path, """\
        kind: Workflow
        name: w
        steps: [{id: a, name: echo}, {id: b, name: echo}, {id: a, name: echo}]
        """)
    assert message.endswith("Workflow 'w': steps[2].id: 'a' is already the id of steps[0]")


def test_output_key_clash(tmp_path: Path) -> None:
    message = workflow_error(tmp_path, """\
        kind: Workflow
        name: w
        steps: [{id: a, name: echo}, {id: b, name: echo, output_key: a}]
        """)
    assert message.endswith("steps[1] 'b'.output_key: 'a' is already the id or output_key of "
                            "step 'a'")


@pytest.mark.parametrize(("step", "expected"), [
    ("{id: 1a, name: echo}", "steps[0].id: '1a' is not a valid name"),
    ("{id: inputs, name: echo}", "steps[0].id: 'inputs' is reserved"),
    ("{id: a, name: echo, type: internal}", "steps[0].type: Input should be 'tool', 'llm'"),
    ("{id: a, name: echo, colour: red}", "steps[0].colour: Extra inputs are not permitted"),
])
def test_step_fields(tmp_path: Path, step: str, expected: str) -> None:
    message = workflow_error(tmp_path, f"kind: Workflow\nname: w\nsteps: [{step}]\n")
    assert expected in message, message


def test_unknown_tool(tmp_path: Path) -> None:
    message = workflow_error(tmp_path, """\
        kind: Workflow
        name: w
        steps: [{id: a, name: ghost}]
        """)
    assert message.startswith("m/workflows.yaml: Workflow 'w': steps[0] 'a': unknown tool "
                              "'ghost'; declare it with kind: Tool (known tools: ")


def test_literal_tool_parameters_are_checked(tmp_path: Path) -> None:
    message = workflow_error(tmp_path, """\
        kind: Workflow
        name: w
        steps: [{id: a, name: calculator, parameters: {expr: "1+1"}}]
        """)
    assert "steps[0] 'a': tool 'calculator': " in message and "expression" in message, message


def test_unknown_agent_and_workflow(tmp_path: Path) -> None:
    message = workflow_error(tmp_path, """\
        kind: Workflow
        name: w
        steps: [{id: a, type: agent, name: ghost}]
        """)
    assert message.endswith("steps[0] 'a': unknown agent 'ghost'; declare it with kind: Agent "
                            "(known agents: none)")
    message = workflow_error(tmp_path, """\
        kind: Workflow
        name: w
        steps: [{id: a, type: workflow, name: ghost}]
        """)
    assert message.endswith("steps[0] 'a': unknown workflow 'ghost'; declare it with kind: "
                            "Workflow (known workflows: w)")


def test_workflows_calling_each_other_in_a_circle(tmp_path: Path) -> None:
    message = workflow_error(tmp_path, """\
        workflows:
          - {name: one, steps: [{id: a, type: workflow, name: two}]}
          - {name: two, steps: [{id: b, type: workflow, name: three}]}
          - {name: three, steps: [{id: c, type: workflow, name: one}]}
        """)
    assert "workflows call each other in a circle: one -> two -> three -> one" in message
    message = workflow_error(tmp_path, """\
        workflows:
          - {name: me, steps: [{id: a, type: workflow, name: me}]}
        """)
    assert message.endswith("steps[0] 'a': a workflow cannot run itself")


def test_literal_workflow_inputs_are_checked(tmp_path: Path) -> None:
    message = workflow_error(tmp_path, """\
        workflows:
          - name: inner
            inputs: {type: object, properties: {x: {type: integer}}, required: [x]}
            steps: [{id: a, name: echo, parameters: {message: "$inputs.x"}}]
          - name: outer
            steps: [{id: b, type: workflow, name: inner, parameters: {x: "three"}}]
        """)
    assert message.endswith("steps[0] 'b': workflow 'inner': inputs.x: 'three' is not of type "
                            "'integer'")


STEP_TYPES = set(get_args(WorkflowStep.model_fields["type"].annotation))


def test_step_types_are_rows_of_the_action_type_table() -> None:
    # every row but `internal` (an agent's own actions; the step model rejects it, see
    # test_step_fields)
    assert set(ACTION_TYPES) - {"internal"} == STEP_TYPES


@pytest.mark.parametrize("step_type", sorted(STEP_TYPES))
def test_every_step_type_is_checked_through_the_action_type_table(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step_type: str) -> None:
    seen: list[Target] = []

    def check(target: Target) -> list[tuple[str, str]]:
        seen.append(target)
        return [("stub", f"{target.label}: the table's {step_type} row says no to "
                         f"{target.name!r}")]

    monkeypatch.setitem(ACTION_TYPES, step_type, replace(ACTION_TYPES[step_type], check=check))
    message = workflow_error(tmp_path, f"""\
        kind: Workflow
        name: w
        model: {{base_url: "http://127.0.0.1:9/v1", model: m, api_key_env: null}}
        steps: [{{id: a, type: {step_type}, name: other, parameters: {{p: 1}}}}]
        """)
    assert message == (f"m/workflows.yaml: Workflow 'w': steps[0] 'a': the table's {step_type} "
                       "row says no to 'other'")
    [target] = seen
    assert (target.label, target.name, target.parameters) == ("steps[0] 'a'", "other", {"p": 1})
    assert target.wording is MANIFEST and target.model is not None
    assert "w" in target.registry.workflows and "echo" in target.registry.tools


def _manifest_problems(step_type: str, name: str, parameters: Any = None,
                       model: ModelConfig | None = None) -> list[tuple[str, str]]:
    target = Target("steps[0] 'a'", name, parameters or {}, load_registry(TEST_MANIFESTS),
                    wording=MANIFEST, model=model)
    return ACTION_TYPES[step_type].check(target)


MANIFEST_MESSAGES = {
    "tool": ("unknown_tool", "steps[0] 'a': unknown tool 'ghost'; declare it with kind: Tool "
                             "(known tools: api_call, "),
    "agent": ("unknown_agent", "steps[0] 'a': unknown agent 'ghost'; declare it with kind: Agent "
                               "(known agents: analyzer, "),
    "workflow": ("unknown_workflow", "steps[0] 'a': unknown workflow 'ghost'; declare it with "
                                     "kind: Workflow (known workflows: diamond, "),
    "relic": ("unknown_relic", "steps[0] 'a': unknown relic 'ghost'; known relics: broken, "),
    "internal": ("unknown_internal_action", "steps[0] 'a': unknown internal action 'ghost' "
                                            "(one of: add_context_feed, "),
    "llm": ("unsupported_action", "steps[0] 'a': llm steps run on the workflow's model; give the "
                                  "workflow a `model`"),
}


@pytest.mark.parametrize("step_type", sorted(MANIFEST_MESSAGES))
def test_every_row_words_its_problems_as_a_manifest_error(step_type: str) -> None:
    assert set(ACTION_TYPES) == set(MANIFEST_MESSAGES)  # a new row words its problems here too
    kind, start = MANIFEST_MESSAGES[step_type]
    [(found_kind, message)] = _manifest_problems(step_type, "ghost")
    assert found_kind == kind
    assert message.startswith(start), message


def test_llm_steps_run_on_the_workflows_model() -> None:
    model = ModelConfig(base_url="http://127.0.0.1:9/v1", model="m", api_key_env=None)
    assert _manifest_problems("llm", "summarise", model=model) == []


def test_workflow_llm_steps_do_not_need_the_model_of_documents(tmp_path: Path) -> None:
    write(tmp_path, "m/workflows.yaml", """\
        kind: Workflow
        name: w
        model: {base_url: "http://127.0.0.1:9/v1", model: m, api_key_env: null}
        steps: [{id: a, type: llm, name: summarise, parameters: {prompt: "$inputs.text"}}]
        """)
    assert [s.type for s in load_registry(tmp_path / "m").workflow("w").steps] == ["llm"]


def test_relic_steps_are_checked(tmp_path: Path) -> None:
    message = workflow_error(tmp_path, """\
        kind: Workflow
        name: w
        steps: [{id: a, type: relic, name: ghost.get}]
        """)
    assert message.startswith("m/workflows.yaml: Workflow 'w': steps[0] 'a': unknown relic "
                              "'ghost'; known relics: "), message


def test_the_action_type_table_imports_first() -> None:
    # workflows.link imports the table, which imports workflows.spec: the package's __init__
    # must not import link, or a process that imports the table first cannot start
    for module in ("cortex_worker.actions.table", "cortex_worker.workflows",
                   "cortex_worker.workflows.link"):
        subprocess.run([sys.executable, "-c", f"import {module}"], check=True, cwd=REPO_ROOT)


@pytest.mark.parametrize(("schema", "expected"), [
    ("{type: string}", "inputs: Value error, the root must be of type 'object'"),
    ("{type: object, properties: {x: {type: 5}}}", "inputs: Value error, not a valid JSON Schema"),
    ("{type: object, required: x}", "inputs: Value error, not a valid JSON Schema"),
])
def test_bad_inputs_schema(tmp_path: Path, schema: str, expected: str) -> None:
    message = workflow_error(tmp_path, f"""\
        kind: Workflow
        name: w
        inputs: {schema}
        steps: [{{id: a, name: echo}}]
        """)
    assert expected.replace("Value error, ", "") in message, message


def test_llm_steps_need_a_model(tmp_path: Path) -> None:
    message = workflow_error(tmp_path, """\
        kind: Workflow
        name: w
        steps: [{id: a, type: llm, name: summarise, parameters: {prompt: "$inputs.text"}}]
        """)
    assert message.endswith("steps[0] 'a': llm steps run on the workflow's model; give the "
                            "workflow a `model`")


def test_no_steps(tmp_path: Path) -> None:
    message = workflow_error(tmp_path, "kind: Workflow\nname: w\nsteps: []\n")
    assert "steps: List should have at least 1 item" in message


# ---------------------------------------------------------------- plan and canvas


def shape(steps: list[dict[str, Any]]) -> Any:
    step = decompose(flow(steps).plan())
    return None if step is None else step.shape()


def names(sig: Any) -> Any:
    """The canvas as nested lists of kinds and action ids."""
    if isinstance(sig, chord):
        return ["chord", [names(t) for t in sig.tasks], names(sig.body)]
    if isinstance(sig, chain):
        return ["chain", *[names(t) for t in sig.tasks]]
    if isinstance(sig, group):
        return ["group", *[names(t) for t in sig.tasks]]
    return sig.args[0]


def canvas(steps: list[dict[str, Any]]) -> Any:
    app = Celery("t", set_as_current=False)
    step = decompose(flow(steps).plan())
    assert step is not None
    return names(to_canvas(step, lambda i: app.signature("cortex.action.canvas", args=[i],
                                                          immutable=True)))


def test_steps_are_async_actions_with_implicit_dependencies() -> None:
    spec = flow([echo("a", "$inputs.x"), echo("b", "${a.field}"), echo("c", ["$a", "$b"]),
                 echo("d", depends_on=["a"], timeout=5, retry=2, on_error="continue")])
    plan = spec.plan()
    assert plan.ok and not plan.warnings  # $inputs is known
    assert {i: n.depends_on for i, n in plan.nodes.items()} == {
        "a": (), "b": ("a",), "c": ("a", "b"), "d": ("a",)}
    assert all(not n.after for n in plan.nodes.values())  # no sync barriers
    d = plan.nodes["d"].action
    assert (d.mode.value, d.timeout, d.retry, d.on_error.value) == ("async", 5, 2, "continue")
    assert [a.line for a in spec.actions()] == [1, 2, 3, 4]


def test_output_key_is_a_dependency() -> None:
    spec = flow([echo("a", output_key="page"), echo("b", "$page")])
    assert spec.plan().nodes["b"].depends_on == ("a",)


def test_sequence_is_a_chain() -> None:
    steps = [echo("a"), echo("b", "$a"), echo("c", "$b")]
    assert shape(steps) == ("chain", ["a", "b", "c"])
    assert canvas(steps) == ["chain", "a", "b", "c"]


def test_fan_out_is_a_chain_into_a_group() -> None:
    steps = [echo("a", "$inputs.x"), echo("b", "$a"), echo("c", "${a.y}")]
    assert shape(steps) == ("chain", ["a", ("group", ["b", "c"])])
    assert canvas(steps) == ["chain", "a", ["group", "b", "c"]]


def test_fan_in_is_a_chord() -> None:
    steps = [echo("a"), echo("b"), echo("c", {"left": "$a", "right": "$b"})]
    assert shape(steps) == ("chain", [("group", ["a", "b"]), "c"])
    assert canvas(steps) == ["chord", ["a", "b"], "c"]


def test_diamond_is_chain_group_chord() -> None:
    steps = [echo("a"), echo("b", "$a"), echo("c", "$a"), echo("d", ["$b", "$c"])]
    assert shape(steps) == ("chain", ["a", ("group", ["b", "c"]), "d"])
    assert canvas(steps) == ["chain", "a", ["chord", ["b", "c"], "d"]]


def test_independent_steps_are_one_group() -> None:
    assert shape([echo("a"), echo("b"), echo("c")]) == ("group", ["a", "b", "c"])


def test_the_test_diamond_compiles_to_its_canvas() -> None:
    diamond = load_registry(TEST_MANIFESTS).workflow("diamond")
    step = decompose(diamond.plan())
    assert step is not None and step.width() == 2
    assert step.shape() == ("chain", ["double", ("group", ["plus_one", "copy"]), "join"])


def test_n_shape_runs_on_readiness() -> None:
    # c after a; d after a and b: any canvas would make c wait for b.
    assert shape([echo("a"), echo("b"), echo("c", "$a"), echo("d", ["$a", "$b"])]) is None


# ---------------------------------------------------------------- inputs and output


def test_input_errors_are_precise() -> None:
    spec = flow([echo("a", "$inputs.x")], inputs={
        "type": "object", "required": ["x"], "additionalProperties": False,
        "properties": {"x": {"type": "integer"}, "tags": {"type": "array",
                                                          "items": {"type": "string"}}}})
    assert spec.input_errors({"x": 1}) == []
    assert spec.input_errors({"x": "1"}) == [("inputs.x", "inputs.x: '1' is not of type 'integer'")]
    assert spec.input_errors({"x": 1, "tags": ["a", 2]}) == [
        ("inputs.tags[1]", "inputs.tags[1]: 2 is not of type 'string'")]
    assert [m for _, m in spec.input_errors({"y": 1})] == [
        "inputs: 'x' is a required property",
        "inputs: Additional properties are not allowed ('y' was unexpected)"]
    assert spec.input_errors([1]) == [("inputs", "inputs: must be an object, got list")]


def test_prepare_inputs_fills_top_level_defaults() -> None:
    spec = flow([echo("a")], inputs={"type": "object", "properties": {
        "x": {"type": "integer"}, "label": {"type": "string", "default": "sum"}}})
    assert spec.prepare_inputs({"x": 1}) == {"x": 1, "label": "sum"}
    assert spec.prepare_inputs({"x": 1, "label": "L"}) == {"x": 1, "label": "L"}


def test_output_defaults_to_the_last_step() -> None:
    assert render_output(None, "d", {"d": {"v": [1, 2]}}) == ({"v": [1, 2]}, [])
    value, unresolved = render_output(None, "d", {})
    assert value is None and [u.text for u in unresolved] == ["$d"]


def test_output_expression_template_and_object() -> None:
    values = {"inputs": {"x": 3, "name": "n"}, "join": {"total": 7, "parts": [6, 1]}, "s": "ok"}
    assert render_output("$join", "s", values) == (values["join"], [])
    assert render_output("${join.total}", "s", values) == (7, [])
    assert render_output("total=$join.total for $inputs.name ($$5)", "s", values) == (
        "total=7 for n ($5)", [])
    rendered, unresolved = render_output(
        {"total": "$join.total", "first": "${join.parts.0}", "all": ["$s", "$inputs.x"],
         "text": "x=$inputs.x", "missing": "$join.nope", "n": 5}, "s", values)
    assert rendered == {"total": 7, "first": 6, "all": ["ok", 3], "text": "x=3",
                        "missing": "$join.nope", "n": 5}
    assert [u.text for u in unresolved] == ["$join.nope"]


def test_failure_message_names_failed_and_skipped_steps() -> None:
    actions = {
        "after": {"spec": {"line": 3, "type": "tool", "name": "echo"}, "status": "skipped",
                  "result": {"error": "dependency bad did not succeed"}},
        "bad": {"spec": {"line": 2, "type": "tool", "name": "fail"}, "status": "error",
                "result": {"error": "RuntimeError: boom"}},
        "ok": {"spec": {"line": 1, "type": "tool", "name": "echo"}, "status": "ok",
               "result": {"value": "start"}},
        "slow": {"spec": {"line": 4, "type": "tool", "name": "sleep"}, "status": "timeout",
                 "result": {"error": "timed out after 1s"}},
    }
    assert failure_message("failing", actions) == (
        "workflow 'failing': step 'bad' (tool fail) failed: RuntimeError: boom; step 'slow' "
        "(tool sleep) timed out: timed out after 1s; not run: after")


# ---------------------------------------------------------------- submission checks


@pytest.fixture
def test_registry(monkeypatch: pytest.MonkeyPatch) -> Any:
    registry = load_registry(TEST_MANIFESTS)
    monkeypatch.setattr(jobs, "get_registry", lambda: registry)
    return registry


def test_submit_rejects_unknown_workflows_and_bad_inputs(test_registry: Any) -> None:
    with pytest.raises(jobs.SubmitError) as info:  # nothing is stored: no store is needed
        jobs.submit_workflow(None, "ghost", {})  # type: ignore[arg-type]
    assert info.value.errors[0]["kind"] == "unknown_workflow"
    assert info.value.message.startswith("no workflow named 'ghost' (registered: diamond, ")
    with pytest.raises(jobs.SubmitError) as info:
        jobs.submit_workflow(None, "diamond", {"x": "three", "y": 1})  # type: ignore[arg-type]
    errors = info.value.errors
    assert [(e["kind"], e["path"]) for e in errors] == [("invalid_inputs", "inputs"),
                                                        ("invalid_inputs", "inputs.x")]
    assert errors[1]["message"] == "workflow 'diamond': inputs.x: 'three' is not of type 'integer'"
    assert info.value.message.endswith("(and 1 more)")


def test_documents_may_run_registered_workflows(test_registry: Any) -> None:
    def kinds(text: str) -> list[str]:
        return [e["kind"] for e in jobs.check_document(load_document(text))]

    ok = '<action type="workflow" id="w">{"name": "diamond", "parameters": {"x": 1}}</action>'
    assert kinds(ok) == []
    later = ('<action id="n" mode="async">{"name": "echo", "parameters": {"message": 2}}</action>'
             '<action type="workflow" id="w">{"name": "diamond", "parameters": {"x": "$n"}}'
             '</action>')
    assert kinds(later) == []  # references are checked when the action runs
    assert kinds('<action type="workflow" id="w">{"name": "ghost"}</action>') == ["unknown_workflow"]
    bad = '<action type="workflow" id="w">{"name": "diamond", "parameters": {"x": "a"}}</action>'
    errors = jobs.check_document(load_document(bad))
    assert [e["kind"] for e in errors] == ["invalid_parameters"]
    assert errors[0]["message"] == ("action 'w' (workflow diamond): inputs.x: 'a' is not of type "
                                    "'integer'")


class FakeStore:
    """The few Store calls `submit_workflow` makes, in memory; job `p` is a running parent."""

    PARENTS = frozenset({"p"})

    def __init__(self) -> None:
        self.jobs: dict[str, JobRecord] = {}
        self.variables: dict[str, dict[str, Any]] = {}
        self.children: dict[str, set[str]] = {}
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def peek(self, job_id: str, *fields: str) -> JobRecord | None:
        if job_id in self.PARENTS:
            return JobRecord(id=job_id, status="running")
        return self.jobs.get(job_id)

    def create_job(self, job_id: str, fields: dict[str, Any], ttl: int,
                   events: list[tuple[str, dict[str, Any]]], *, session: Any = None,
                   variables: dict[str, Any] | None = None,
                   conversation: Any = ()) -> JobRecord | None:
        if job_id in self.jobs:  # as the store: the job asked for again is found, not made
            return self.jobs[job_id]
        assert session is None and not conversation  # a workflow's child run has neither
        self.jobs[job_id] = JobRecord.from_hash(encode({"id": job_id, "status": "queued", **fields}))
        self.variables[job_id] = dict(variables or {})
        self.emit(job_id, events)
        return None

    def add_child(self, job_id: str, child: str) -> None:
        self.children.setdefault(job_id, set()).add(child)

    def emit(self, job_id: str, events: list[tuple[str, dict[str, Any]]], *,
             live: bool = False) -> None:
        self.events += [(job_id, kind, data) for kind, data in events]


def test_a_child_run_is_created_once(test_registry: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[str] = []
    monkeypatch.setattr(jobs.dispatch, "start_job", started.append)
    store = FakeStore()
    first = jobs.submit_workflow(store, "diamond", {"x": 2}, parent=("p", "wf"), depth=1)  # type: ignore[arg-type]
    again = jobs.submit_workflow(store, "diamond", {"x": 2}, parent=("p", "wf"), depth=1)  # type: ignore[arg-type]
    assert first == again and list(store.jobs) == [first] and store.children == {"p": {first}}
    assert started == [first, first]  # still queued: its start is sent again (harmless)
    job = store.jobs[first]
    assert (job.kind, job.workflow, job.parent_job, job.parent_action, job.depth) \
        == ("workflow", "diamond", "p", "wf", 1)
    assert [a["id"] for a in job.actions] == ["double", "plus_one", "copy", "join"]
    assert job.output == {"template": test_registry.workflow("diamond").output, "default": "join"}
    assert store.variables[first] == {"inputs": {"x": 2, "label": "sum"}}
    store.jobs[first] = job.model_copy(update={"status": "running"})
    assert jobs.submit_workflow(store, "diamond", {"x": 2}, parent=("p", "wf")) == first  # type: ignore[arg-type]
    assert started == [first, first]
    other = jobs.submit_workflow(store, "diamond", {"x": 2}, parent=("p", "wf2"))  # type: ignore[arg-type]
    assert other != first
    assert [(j, k) for j, k, _ in store.events] == [
        (first, "job_queued"), ("p", "child_job"), (other, "job_queued"), ("p", "child_job")]


def test_job_create_takes_exactly_one_kind() -> None:
    body = JobCreate.model_validate({"workflow": "diamond", "inputs": {"x": 1}})
    assert body.workflow == "diamond" and body.inputs == {"x": 1}
    assert JobCreate.model_validate({"workflow": "diamond"}).inputs == {}
    for bad in ({"workflow": "w", "protocol": "<response>x</response>"},
                {"workflow": "w", "agent": "tester", "input": "hi"}, {}):
        with pytest.raises(ValidationError, match="give exactly one of"):
            JobCreate.model_validate(bad)
    with pytest.raises(ValidationError, match="`inputs` goes with `workflow`"):
        JobCreate.model_validate({"protocol": "<response>x</response>", "inputs": {"x": 1}})


# ---------------------------------------------------------------- registry routes


@pytest.fixture
def client() -> TestClient:
    """The real app, without its lifespan (so no Redis), on the test manifests."""
    app = create_app(Settings(manifests=TEST_MANIFESTS))
    registry = load_registry(TEST_MANIFESTS)
    app.dependency_overrides[registry_dep] = lambda: registry
    return TestClient(app)


def test_workflow_routes(client: TestClient) -> None:
    items = client.get("/v1/workflows").json()["items"]
    assert [i["name"] for i in items] == ["diamond", "failing", "main_workflow", "nested", "sleepy"]
    diamond = items[0]
    assert diamond["inputs"]["required"] == ["x"]
    assert [(s["id"], s["depends_on"]) for s in diamond["steps"]] == [
        ("double", []), ("plus_one", ["double"]), ("copy", ["double"]),
        ("join", ["copy", "plus_one"])]
    detail = client.get("/v1/workflows/diamond").json()
    assert detail["waves"] == [["double"], ["plus_one", "copy"], ["join"]]
    assert detail["canvas"] == ["chain", ["double", ["group", ["plus_one", "copy"]], "join"]]
    assert detail["output"]["total"] == "${join.plus_one}"
    missing = client.get("/v1/workflows/ghost")
    assert missing.status_code == 404
    assert missing.json()["detail"]["message"] == "workflow 'ghost' not found"


def test_llm_actions_in_documents_need_themodel_of_document(
        test_registry: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    text = ('<action type="llm" id="sum">{"name": "summarize", "parameters": {"prompt": "x"}}'
            '</action>')
    monkeypatch.setattr(jobs, "get_settings", lambda: Settings(document_model=None))
    errors = jobs.check_document(load_document(text))
    assert [e["kind"] for e in errors] == ["unsupported_action"]
    assert "set CORTEX_DOCUMENT_MODEL" in errors[0]["message"]
    model = ModelConfig(base_url="http://127.0.0.1:9/v1", model="docs", api_key_env=None)
    settings = Settings(document_model=model)
    monkeypatch.setattr(jobs, "get_settings", lambda: settings)
    assert jobs.check_document(load_document(text)) == []
    # the job option `model` names another model at the same endpoint
    field = jobs.model_of_document(settings, jobs.JobOptions(model="bigger"))
    assert field["model"]["model"] == "bigger"
    assert field["model"]["base_url"] == "http://127.0.0.1:9/v1"
    assert jobs.model_of_document(Settings(document_model=None), jobs.JobOptions()) == {}
