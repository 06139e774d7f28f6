"""`kind: Tool` manifests: the ToolSpec model, the built-in tools' specs, parameter validation
and queue routing. Nothing here imports a tool's implementation: the API lists tools from it."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, ValidationError, best_match
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from pydantic_core import ValidationError as PydanticValidationError

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

Runtime = Literal["python", "shell", "docker", "builtin", "mcp"]
DECLARED_RUNTIMES = ("python", "shell", "docker", "builtin")
"""The runtimes a `kind: Tool` names (`mcp` tools come from `kind: MCPServer`)."""

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
    "builtin": (set(), {"entrypoint"}),
    "mcp": ({"server"}, {"server"}),
}


class Limits(BaseModel):
    """rlimits applied to a tool's sandboxed process tree (inherited by its children)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu_seconds: int = Field(default=30, gt=0, description="RLIMIT_CPU (SIGXCPU, then SIGKILL +1s)")
    memory_mb: int = Field(default=512, gt=0, description="RLIMIT_AS: address space, not RSS")
    processes: int = Field(default=64, gt=0, description="RLIMIT_NPROC (per user; not for root)")
    file_mb: int = Field(default=64, gt=0, description="RLIMIT_FSIZE: largest file it may write")


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
    entrypoint: str | None = Field(
        default=None, description="python: module:function, run in the sandbox; builtin: the "
        "worker's module:function, imported when a worker first runs the tool"
    )
    command: list[str] | None = Field(
        default=None, min_length=1, description="shell/docker argv template with {param}s"
    )
    image: str | None = Field(default=None, min_length=1, description="docker image")
    server: str | None = Field(
        default=None, description="mcp: the MCP server (kind: MCPServer) that runs it; the "
        "tool's name there is what follows `<server>.`"
    )
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    returns: dict[str, Any] | None = Field(default=None, description="documentation only")
    timeout: float | None = Field(default=None, gt=0, description="seconds; caps the action's")
    max_concurrency: int | None = Field(
        default=None, gt=0, description="calls of this tool that run at once across the whole "
        "cluster; the others wait, without holding a worker slot, until one ends")
    require_approval: bool = Field(
        default=False, description="every call waits, holding no worker slot, until a person "
        "approves it (POST /v1/jobs/{id}/actions/{action}/approve) or rejects it")
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
    _mcp_server: Any = PrivateAttr(default=None)

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        return check_name(name, "tool")

    @field_validator("runtime", mode="wrap")
    @classmethod
    def _runtime(cls, runtime: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(runtime)
        except PydanticValidationError:  # name what a manifest may write, not `mcp`
            *first, last = DECLARED_RUNTIMES
            raise PydanticCustomError(
                "literal_error", "Input should be {expected}",
                {"expected": f"{', '.join(map(repr, first))} or {last!r}"}) from None

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
        fields = ("entrypoint", "command", "image", "server", *_DOCKER_OPTIONS)
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

    @property
    def mcp_server(self) -> Any:
        """mcp: the `MCPServerSpec` of `server` (set by `cortex_worker.services.mcp.spec`), or None."""
        return self._mcp_server


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
    """The Celery queue that runs this tool: MCP tools run where their server lives, on the
    relic pool (one long-lived server per worker process, see docs/relics.md)."""
    return {"docker": "docker", "mcp": "relic"}.get(spec.runtime, "tool")


# ---------------------------------------------------------------- built-in tools


def _builtin(name: str, function: str, description: str, parameters: dict[str, Any],
             **extra: Any) -> ToolSpec:
    return ToolSpec(name=name, description=description, runtime="builtin",
                    entrypoint=f"cortex_worker.tools.builtin:{function}", parameters=parameters,
                    **extra)


def _object(
    properties: dict[str, Any], required: tuple[str, ...] = (), **extra: Any
) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": list(required)}
    schema.setdefault("additionalProperties", False)
    schema.update(extra)
    return schema


_PATH = {"type": "string", "minLength": 1, "description": "relative to the job workspace"}
_MAX_BYTES = {"type": "integer", "minimum": 1, "maximum": 16 * 1024 * 1024}

BUILTIN_TOOLS: dict[str, ToolSpec] = {spec.name: spec for spec in (
    _builtin(
        "echo", "echo",
        "Return `message`, or the whole parameters object when there is no `message`.",
        {"type": "object", "properties": {"message": {"description": "any JSON value"}}},
    ),
    _builtin(
        "sleep", "sleep",
        "Sleep for `seconds` (at most the action's timeout) and return {slept}.",
        _object({"seconds": {"type": "number", "minimum": 0}}, ("seconds",)),
        returns=_object({"slept": {"type": "number"}}),
    ),
    _builtin(
        "calculator", "calculate",
        "Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses, "
        "sqrt log log10 log2 exp sin cos tan floor ceil abs round min max, pi e tau.",
        _object({"expression": {"type": "string", "minLength": 1, "maxLength": 1000}},
                ("expression",)),
        returns={"type": "number"},
    ),
    _builtin(
        "python", "python",
        "Run a Python snippet in a sandbox in the job workspace; returns what it printed "
        "and the value of its last expression.",
        _object({"code": {"type": "string", "minLength": 1}}, ("code",)),
        returns=_object({"stdout": {"type": "string"}, "result": {}}),
    ),
    _builtin(
        "http_get", "http_get",
        "HTTP GET on a loopback or allow-listed host; returns status, headers, text.",
        _object(
            {
                "url": {"type": "string", "minLength": 1},
                "headers": {"type": "object", "additionalProperties": {"type": "string"}},
                "max_bytes": _MAX_BYTES,
            },
            ("url",),
        ),
        returns=_object(
            {
                "status": {"type": "integer"},
                "url": {"type": "string"},
                "headers": {"type": "object"},
                "text": {"type": "string"},
                "truncated": {"type": "boolean"},
            }
        ),
    ),
    _builtin(
        "read_file", "read_file",
        "Read a text file of the job workspace.",
        _object({"path": _PATH, "max_bytes": _MAX_BYTES}, ("path",)),
        returns=_object(
            {
                "path": {"type": "string"},
                "content": {"type": "string"},
                "size": {"type": "integer"},
                "truncated": {"type": "boolean"},
            }
        ),
    ),
    _builtin(
        "write_file", "write_file",
        "Write (or append) a text file in the job workspace, creating directories.",
        _object(
            {"path": _PATH, "content": {"type": "string"}, "append": {"type": "boolean"}},
            ("path", "content"),
        ),
        returns=_object(
            {
                "path": {"type": "string"},
                "bytes": {"type": "integer"},
                "appended": {"type": "boolean"},
            }
        ),
    ),
    _builtin(
        "grep", "grep",
        "Search the workspace's text files for a regular expression; returns "
        "[{path, line, text}].",
        _object(
            {
                "pattern": {"type": "string", "minLength": 1},
                "path": {**_PATH, "default": "."},
                "max_matches": {"type": "integer", "minimum": 1, "maximum": 10000},
                "ignore_case": {"type": "boolean"},
            },
            ("pattern",),
        ),
        returns={
            "type": "array",
            "items": _object(
                {
                    "path": {"type": "string"},
                    "line": {"type": "integer"},
                    "text": {"type": "string"},
                }
            ),
        },
    ),
)}
"""The tools built into every worker, by name; each `entrypoint` is its `fn(params, ctx)`."""
