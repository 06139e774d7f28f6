"""`kind: Tool` manifests: the ToolSpec model, parameter validation and queue routing."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, ValidationError, best_match
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from cortex_worker.sandbox.limits import Limits
from cortex_worker.tools.errors import ToolError

__all__ = [
    "Limits",
    "Runtime",
    "ToolSpec",
    "placeholders",
    "queue_for",
    "render_argv",
    "validate_parameters",
]

Runtime = Literal["python", "shell", "docker", "builtin"]

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
"""A tool or workflow name."""
PLAIN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")
"""A relic or operation name: no dots (`relic.operation` names an operation)."""
ENTRYPOINT = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$", re.ASCII)
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# `{name}` is a placeholder; `{{` and `}}` are literal braces (as in str.format).
_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Container options, for runtime docker only (None: the default, see docs/docker.md).
_DOCKER_OPTIONS = ("network", "cpus", "read_only", "workdir")

_RUNTIME_FIELDS: dict[str, tuple[set[str], set[str]]] = {
    # runtime: (required fields, allowed fields among entrypoint / command / image / docker's)
    "python": ({"entrypoint"}, {"entrypoint", "network"}),
    "shell": ({"command"}, {"command", "network"}),
    "docker": ({"image"}, {"image", "command", *_DOCKER_OPTIONS}),
    "builtin": (set(), set()),
}


def check_env_names(env: dict[str, str]) -> dict[str, str]:
    """Extra environment variables of a manifest: names must be valid variable names."""
    bad = [name for name in env if not ENV_NAME.match(name)]
    if bad:
        raise ValueError(f"invalid environment variable name(s): {', '.join(map(repr, bad))}")
    return env


class ToolSpec(BaseModel):
    """One tool: what it takes (JSON Schema), how it runs, and its limits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["Tool"] = "Tool"
    name: str = Field(description="letters, digits, _ . -; at most 64")
    description: str = ""
    runtime: Runtime
    entrypoint: str | None = Field(default=None, description="python: module:function")
    command: list[str] | None = Field(
        default=None, min_length=1, description="shell/docker argv template with {param}s"
    )
    image: str | None = Field(default=None, min_length=1, description="docker image")
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    returns: dict[str, Any] | None = Field(default=None, description="documentation only")
    timeout: float | None = Field(default=None, gt=0, description="seconds; caps the action's")
    limits: Limits = Field(default_factory=Limits)
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables")
    network: Literal["none", "host"] | None = Field(
        default=None, description="'none' (the default: no network at all) or 'host'; python "
        "and shell tools run in a network namespace of their own unless 'host'"
    )
    cpus: float | None = Field(default=None, gt=0, le=1024, description="docker: CPUs (default 1)")
    read_only: bool | None = Field(default=None, description="docker: read-only root (default)")
    workdir: str | None = Field(
        default=None, pattern=r"^/[^\x00]*$", description="docker: absolute (default /workspace)"
    )

    _validator: Draft202012Validator | None = PrivateAttr(default=None)

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        return check_name(name, "tool")

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint(cls, entrypoint: str | None) -> str | None:
        if entrypoint is not None and not ENTRYPOINT.match(entrypoint):
            raise ValueError(
                f"must look like 'module:function' (e.g. 'mytools:search' or "
                f"'pkg.mod:run'), got {entrypoint!r}"
            )
        return entrypoint

    @field_validator("parameters")
    @classmethod
    def _parameters_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        return check_object_schema(schema, "parameters")

    @field_validator("returns")
    @classmethod
    def _returns_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is not None:
            check_schema(schema)
        return schema

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        return check_env_names(env)

    @model_validator(mode="after")
    def _runtime_fields(self) -> ToolSpec:
        required, allowed = _RUNTIME_FIELDS[self.runtime]
        fields = ("entrypoint", "command", "image", *_DOCKER_OPTIONS)
        given = {f for f in fields if getattr(self, f) is not None}
        if missing := sorted(required - given):
            raise ValueError(f"runtime {self.runtime!r} needs {' and '.join(missing)}")
        if extra := sorted(given - allowed):
            raise ValueError(f"runtime {self.runtime!r} does not use {', '.join(extra)}; remove it")
        if self.command is not None:
            self._check_placeholders()
        return self

    def _check_placeholders(self) -> None:
        properties = self.parameters.get("properties") or {}
        required = set(self.parameters.get("required") or ())
        for index, arg in enumerate(self.command or ()):
            for name in placeholders(arg, where=f"command[{index}]"):
                if name not in properties:
                    raise ValueError(
                        f"command[{index}] uses {{{name}}} but 'parameters' declares no property "
                        f"{name!r}; declare it under parameters.properties"
                    )
                if name not in required and "default" not in properties[name]:
                    raise ValueError(
                        f"command[{index}] uses {{{name}}}: list {name!r} in parameters.required "
                        "or give it a default"
                    )

    @property
    def validator(self) -> Draft202012Validator:
        if self._validator is None:
            self._validator = Draft202012Validator(
                self.parameters, format_checker=Draft202012Validator.FORMAT_CHECKER
            )
        return self._validator


def check_name(name: str, kind: str, *, dots: bool = True) -> str:
    """A manifest's name: a letter or '_', then letters, digits, '_', '-' (and '.' unless
    `dots` is False), at most 64 characters."""
    if (NAME if dots else PLAIN_NAME).match(name):
        return name
    rest = "letters, digits, '_', '.' or '-' (at most 64 characters)" if dots else \
        "letters, digits, '_' or '-' (at most 64 characters, no dots)"
    raise ValueError(f"{name!r} is not a valid {kind} name: start with a letter or '_', then "
                     f"{rest}")


def check_schema(schema: dict[str, Any]) -> None:
    """A valid JSON Schema (Draft 2020-12), or ValueError saying where it is not."""
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise ValueError(
            f"not a valid JSON Schema: {exc.message}" + (f" (at {where})" if where else "")
        ) from None


def check_object_schema(schema: dict[str, Any], what: str) -> dict[str, Any]:
    """A valid JSON Schema whose root is an object: `what` (parameters, inputs) are named."""
    check_schema(schema)
    declared = schema.get("type", "object")
    if declared != "object" and declared != ["object"]:
        raise ValueError(f"the root must be of type 'object' ({what} are named), got {declared!r}")
    return schema


def placeholders(arg: str, *, where: str = "argument") -> list[str]:
    """The `{name}`s of one argv template element; `{{`/`}}` are literal braces."""
    names = []
    for match in _TOKEN.finditer(arg):
        token = match.group(0)
        if token in ("{{", "}}"):
            continue
        name = match.group(1)
        if name is None or not _IDENT.match(name):
            raise ValueError(
                f"{where}: bad placeholder {token!r} in {arg!r}; write {{name}} for a parameter "
                "or {{ and }} for literal braces"
            )
        names.append(name)
    return names


def render_argv(spec: ToolSpec, params: dict[str, Any]) -> list[str]:
    """The argv of a shell/docker tool: each `{name}` replaced by that parameter, per argument.

    Strings are inserted as they are, anything else as JSON. Never goes through a shell.
    """
    properties = spec.parameters.get("properties") or {}

    def value(name: str) -> str:
        if name in params:
            v = params[name]
        elif "default" in properties.get(name, {}):
            v = properties[name]["default"]
        else:
            raise ToolError(f"parameter {name!r} is required by the command of tool {spec.name!r}")
        return v if isinstance(v, str) else json.dumps(v)

    def substitute(match: re.Match[str]) -> str:
        token = match.group(0)
        if token in ("{{", "}}"):
            return token[0]
        return value(match.group(1))

    return [_TOKEN.sub(substitute, arg) for arg in spec.command or ()]


def validate_parameters(spec: ToolSpec, params: Any) -> None:
    """Raise ToolError naming the first bad parameter (JSON Schema Draft 2020-12)."""
    if not isinstance(params, dict):
        raise ToolError(f"parameters must be an object, got {type(params).__name__}")
    error = best_match(spec.validator.iter_errors(params))
    if error is not None:
        raise ToolError(describe_error(error))


def describe_error(error: ValidationError) -> str:
    """ "parameter 'expression': 5 is not of type 'string'" (or "parameters: ..." at the root)."""
    path = list(error.absolute_path)
    if not path:
        return f"parameters: {error.message}"
    text = str(path[0])
    for part in path[1:]:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return f"parameter {text!r}: {error.message}"


def queue_for(spec: ToolSpec) -> str:
    """The Celery queue that runs this tool."""
    return "docker" if spec.runtime == "docker" else "tool"
