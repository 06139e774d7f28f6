"""An agent's `output_schema` at load (cortex_worker/agents/output.py, the loader): a JSON
Schema is checked against the 2020-12 meta-schema, a pydantic model of a tool module
(`module:Class`) becomes its schema, and a final response is read against it."""

from __future__ import annotations

from pathlib import Path

import pytest

from cortex_worker.agents import output
from cortex_worker.manifests.loader import load_registry
from tests.manifest_helpers import load_error, write

AGENT = "agents:\n  - name: a\n    output_schema: {schema}\n"


def test_a_json_schema_is_checked_at_load(tmp_path: Path) -> None:
    write(tmp_path, "m/agents.yaml", AGENT.format(schema='{type: object, required: [x]}'))
    assert load_registry(tmp_path / "m").agent("a").output_schema == {
        "type": "object", "required": ["x"]}
    write(tmp_path, "n/agents.yaml", AGENT.format(schema="{type: objekt}"))
    error = load_error(tmp_path / "n")
    assert "output_schema" in error and "not a JSON Schema" in error and "objekt" in error


def test_a_pydantic_model_of_a_tool_module_becomes_its_schema(tmp_path: Path) -> None:
    write(tmp_path, "m/report_models.py", "from pydantic import BaseModel\n\n\n"
          "class Report(BaseModel):\n    title: str\n    score: int\n")
    write(tmp_path, "m/agents.yaml", AGENT.format(schema="report_models:Report"))
    schema = load_registry(tmp_path / "m").agent("a").output_schema
    assert isinstance(schema, dict) and schema["required"] == ["title", "score"]
    write(tmp_path, "n/agents.yaml", AGENT.format(schema="report_models:Missing"))
    assert "cannot be loaded" in load_error(tmp_path / "n")
    write(tmp_path, "o/agents.yaml", AGENT.format(schema="Report"))
    assert "module:Class" in load_error(tmp_path / "o")


@pytest.mark.parametrize(("text", "value", "problems"), [
    ('{"answer": 42}', {"answer": 42}, []),
    ('```json\n{"answer": 42}\n```', {"answer": 42}, []),
    ('  ```\n{"answer": 42}\n```  ', {"answer": 42}, []),
    ('{"answer": "x"}', {"answer": "x"}, ["field answer: 'x' is not of type 'integer'"]),
    ("{}", {}, ["the value: 'answer' is a required property"]),
])
def test_a_final_response_is_read_against_the_schema(text: str, value: object,
                                                     problems: list[str]) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"]}
    assert output.parse(text, schema) == (value, problems)


def test_prose_is_not_a_value() -> None:
    value, problems = output.parse("It is 42.", {"type": "integer"})
    assert value is None and problems[0].startswith("the final response is not JSON")
