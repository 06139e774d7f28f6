"""Tools written as Python functions (`@tool`): their specs, the registry, and real runs in
the sandbox."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel

from cortex_api.app import create_app
from cortex_api.routes.registry import registry_dep
from cortex_worker.agents.prompt import build_system_prompt
from cortex_worker.manifests.loader import ManifestError, load_registry
from cortex_worker.settings import Settings
from cortex_worker.tools.context import ToolContext
from cortex_worker.tools.errors import ToolError
from cortex_worker.tools.function import FunctionTool, tool
from cortex_worker.tools.runtime import run_tool
from tests.manifest_helpers import TEST_MANIFESTS, write

pytestmark = pytest.mark.process


class Filter(BaseModel):
    field: str
    values: list[int] = []


@tool(timeout=7, network=True)
async def search(query: str, filters: Filter | None = None, limit: int = 5) -> list[str]:
    """Search the catalogue.

    Longer text that is not the description."""
    return [query] * limit


def test_the_spec_comes_from_type_hints_and_docstring() -> None:
    assert isinstance(search, FunctionTool)
    spec = search.spec("catalogue:search")
    assert (spec.name, spec.runtime, spec.entrypoint, spec.timeout, spec.network) == (
        "search", "python", "catalogue:search", 7.0, "host")
    assert spec.description == "Search the catalogue."
    assert spec.parameters == {
        "type": "object", "additionalProperties": False, "required": ["query"],
        "properties": {
            "query": {"type": "string"},
            "filters": {"anyOf": [{"$ref": "#/$defs/Filter"}, {"type": "null"}], "default": None},
            "limit": {"type": "integer", "default": 5}},
        "$defs": {"Filter": {"type": "object", "required": ["field"], "properties": {
            "field": {"type": "string"},
            "values": {"type": "array", "items": {"type": "integer"}, "default": []}}}}}


def test_calling_a_function_tool_validates_into_the_annotated_types() -> None:
    @tool
    def describe(filters: Filter) -> str:
        return f"{type(filters).__name__}:{filters.field}:{filters.values}"

    assert describe(filters={"field": "year", "values": ["3"]}) == "Filter:year:[3]"
    with pytest.raises(ToolError, match=r"filters.values.0: Input should be a valid integer"):
        describe(filters={"field": "year", "values": ["x"]})


def test_parameters_must_be_nameable_in_json() -> None:
    with pytest.raises(TypeError, match="no \\*args"):
        tool(lambda *items: items)


def test_the_registry_lists_function_tools_like_yaml_tools() -> None:
    registry = load_registry(TEST_MANIFESTS)
    distance, shout = registry.tools["distance"], registry.tools["shout"]
    assert (distance.entrypoint, shout.entrypoint, shout.timeout) == (
        "function_tools:distance", "function_tools:shout", 5.0)
    assert registry.source("Tool", "shout") == "tests/manifests/function_tools.yaml (module function_tools)"
    app = create_app(Settings(manifests=TEST_MANIFESTS))
    app.dependency_overrides[registry_dep] = lambda: registry
    body = TestClient(app).get("/v1/tools/distance").json()
    assert body["description"] == "Distance between two points."
    assert body["parameters"]["required"] == ["a", "b"]


def test_an_agent_prompt_shows_function_tools(tmp_path: Path) -> None:
    write(tmp_path, "tools.py", '''
        from cortex_worker.tools.function import tool

        @tool
        def greet(name: str) -> str:
            """Say hello to `name`."""
            return f"hello {name}"
        ''')
    write(tmp_path, "agent.yaml", """
        kind: Agent
        name: greeter
        model: {provider: openai, base_url: "http://127.0.0.1:9", model: m, api_key_env: null}
        tools: [greet]
        """)
    registry = load_registry(tmp_path, tool_modules=["tools"])
    prompt = build_system_prompt(registry.agents["greeter"], registry)
    assert "- greet: Say hello to `name`." in prompt


def test_a_module_that_does_not_import_is_a_clear_manifest_error(tmp_path: Path) -> None:
    write(tmp_path, "broken.yaml", "kind: ToolModule\nname: nowhere_to_be_found\n")
    with pytest.raises(ManifestError, match=r"broken\.yaml: tool module 'nowhere_to_be_found' "
                                            r"cannot be loaded: ModuleNotFoundError"):
        load_registry(tmp_path)


@pytest.mark.parametrize(("name", "params", "expected"), [
    ("distance", {"a": {"x": 0, "y": 0}, "b": {"x": 3, "y": 4}}, 5.0),
    ("shout", {"text": "hi", "times": 2}, {"said": "HI HI"}),  # async
])
def test_function_tools_run_in_the_sandbox(tmp_path: Path, name: str, params: dict[str, Any],
                                           expected: Any) -> None:
    registry = load_registry(TEST_MANIFESTS)
    ctx = ToolContext.for_job(Settings(workspace_root=tmp_path), "job-1", "act-1", timeout=20)
    assert run_tool(registry.tools[name], params, ctx, registry.module_paths) == expected


def test_a_function_tool_gets_the_same_validation_before_it_runs(tmp_path: Path) -> None:
    registry = load_registry(TEST_MANIFESTS)
    ctx = ToolContext.for_job(Settings(workspace_root=tmp_path), "job-1", "act-1", timeout=20)
    with pytest.raises(ToolError, match="'y' is a required property"):
        run_tool(registry.tools["distance"], {"a": {"x": 0}, "b": {"x": 1, "y": 1}}, ctx,
                 registry.module_paths)
