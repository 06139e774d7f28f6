"""Typed final output: an agent's `output_schema`, and a final response read against it.

A program that calls an agent wants a value, not prose (the OpenAI Agents SDK's `output_type`,
Pydantic AI's `output_type`). An agent that declares `output_schema` (a JSON Schema, or a
pydantic model of one of its tool modules, `module:Class`) ends with the parsed value of its
final response; one that does not validate is refused, and the model is told why, naming the
fields (`rejections`).
"""

from __future__ import annotations

import importlib
import json
import re
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel

from cortex_worker.errors import CortexError

FENCE = re.compile(r"^\s*```[A-Za-z0-9_-]*[ \t]*\n(?P<body>.*?)\n?[ \t]*```\s*$", re.S)
"""A response written as one fenced block (```json ... ```), as models often do."""


class OutputSchemaError(CortexError, ValueError):
    """An `output_schema` that is not a JSON Schema, or names no pydantic model."""


def resolve(value: dict[str, Any] | str) -> dict[str, Any]:
    """The JSON Schema `value` gives: itself (checked against the 2020-12 meta-schema), or
    the schema of the pydantic model it names as `module:Class` (the module importable as the
    agent's tool modules are)."""
    if isinstance(value, str):
        module_name, _, name = value.partition(":")
        if not module_name or not name:
            raise OutputSchemaError(f"output_schema {value!r}: name a pydantic model as "
                                    "module:Class, or give a JSON Schema object")
        try:
            model = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError) as exc:
            raise OutputSchemaError(f"output_schema {value!r} cannot be loaded: "
                                    f"{type(exc).__name__}: {exc}") from None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise OutputSchemaError(f"output_schema {value!r} is not a pydantic model")
        return model.model_json_schema()
    try:
        Draft202012Validator.check_schema(value)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "(the schema)"
        raise OutputSchemaError(f"output_schema is not a JSON Schema: at {where}: "
                                f"{exc.message}") from None
    return value


def parse(text: str, schema: dict[str, Any]) -> tuple[Any, list[str]]:
    """The value of a final response (a JSON document, perhaps in one fenced block) and what
    keeps it from matching `schema`: each problem names its field (empty: it is the value)."""
    fenced = FENCE.match(text)
    body = fenced.group("body") if fenced else text
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, [f"the final response is not JSON ({exc.msg} at line {exc.lineno}, "
                      f"column {exc.colno}): answer with one JSON value that matches the "
                      "output schema"]
    problems = sorted(Draft202012Validator(schema).iter_errors(value),
                      key=lambda e: [str(p) for p in e.absolute_path])
    return value, [f"{_field(e.absolute_path)}: {e.message}" for e in problems]


def _field(path: Any) -> str:
    parts = list(path)
    return "field " + ".".join(str(p) for p in parts) if parts else "the value"


def rejection(problems: list[str]) -> str:
    """What the model is told (and the job's error, once it may not try again)."""
    return "the final response does not match the output schema: " + "; ".join(problems)
