"""`kind: Relic` manifests, the built-in relics, and how an action names an operation.

A relic is a long-lived service with named operations. `runtime: http` relics are user
programs that Cortex starts (see `manager`); `runtime: builtin` is reserved for the relics
built into the worker (`kv`, `sql`, see `builtin`).

An action names an operation in one of two ways (see `resolve`):

    {"name": "kv.set", "parameters": {"key": "a", "value": 1}}
    {"name": "kv", "parameters": {"operation": "set", "key": "a", "value": 1}}

In the dotted form the parameters are the operation's parameters as they are; in the other
form `operation` is taken out of them first.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from cortex_worker.protocol.variables import find_references
from cortex_worker.tools.errors import ToolError
from cortex_worker.tools.spec import (
    PLAIN_NAME,
    check_env_names,
    check_name,
    check_object_schema,
    describe_error,
)

COMMAND_PLACEHOLDERS = ("port", "python", "manifest_dir")
"""What `{...}` may name in a relic's `command`."""
# `{name}` is a placeholder; `{{` and `}}` are literal braces (as in str.format).
_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

Method = Literal["GET", "POST", "PUT", "DELETE"]


class RelicCallError(ToolError):
    """An action that names no existing relic / operation, or gives bad parameters.

    `kind` is the document error kind: unknown_relic, unknown_operation, invalid_parameters.
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def placeholders(text: str, *, where: str) -> list[str]:
    """The `{name}`s of a template; `{{` / `}}` are literal braces. ValueError if malformed."""
    names = []
    for match in _TOKEN.finditer(text):
        token = match.group(0)
        if token in ("{{", "}}"):
            continue
        name = match.group(1)
        if name is None or not _IDENT.match(name):
            raise ValueError(
                (f"{where}: " if where else "")
                + f"bad placeholder {token!r} in {text!r}; write {{name}} for a "
                "parameter or {{ and }} for literal braces"
            )
        names.append(name)
    return names


def fill(text: str, values: Mapping[str, str]) -> str:
    """`text` with each `{name}` replaced by `values[name]` (`{{`, `}}`: literal braces)."""

    def one(match: re.Match[str]) -> str:
        token = match.group(0)
        if token in ("{{", "}}"):
            return token[0]
        return values[match.group(1)]

    return _TOKEN.sub(one, text)


class HealthSpec(BaseModel):
    """How Cortex tells that an http relic is up: `GET <path>` answers 2xx within timeout_s."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(default="/health", description="starts with '/'")
    interval_s: float = Field(default=10.0, gt=0,
                              description="check again before a call if the last is older")
    timeout_s: float = Field(default=2.0, gt=0, description="one check's time limit")

    @field_validator("path")
    @classmethod
    def _path(cls, path: str) -> str:
        if not path.startswith("/"):
            raise ValueError(f"must start with '/', got {path!r}")
        if "{" in path or "}" in path:
            raise ValueError(f"takes no placeholders, got {path!r}")
        return path


class OperationSpec(BaseModel):
    """One named operation: its HTTP method and path (http relics) and its parameters."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Method = "POST"
    path: str | None = Field(default=None,
                             description="http relics: starts with '/', may hold {param}s")
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    description: str = ""

    _validator: Draft202012Validator | None = PrivateAttr(default=None)

    @field_validator("method", mode="before")
    @classmethod
    def _upper(cls, method: Any) -> Any:
        return method.upper() if isinstance(method, str) else method

    @field_validator("parameters")
    @classmethod
    def _schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        return check_object_schema(schema, "parameters")

    @field_validator("path")
    @classmethod
    def _path(cls, path: str | None) -> str | None:
        if path is not None:
            if not path.startswith("/"):
                raise ValueError(f"must start with '/', got {path!r}")
            placeholders(path, where="")
        return path

    @property
    def path_parameters(self) -> list[str]:
        return placeholders(self.path, where="path") if self.path else []

    @property
    def validator(self) -> Draft202012Validator:
        if self._validator is None:
            self._validator = Draft202012Validator(
                self.parameters, format_checker=Draft202012Validator.FORMAT_CHECKER
            )
        return self._validator


class RelicSpec(BaseModel):
    """A relic: a long-lived service with named operations (`kind: Relic`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["Relic"] = "Relic"
    name: str = Field(description="letters, digits, _ -; at most 64; no dots")
    description: str = ""
    runtime: Literal["builtin", "http"]
    command: list[str] | None = Field(
        default=None, min_length=1,
        description="http: argv; {port}, {python} and {manifest_dir} are filled in")
    health: HealthSpec = Field(default_factory=HealthSpec)
    startup_timeout_s: float = Field(default=30.0, gt=0)
    idle_timeout_s: float = Field(default=300.0, gt=0)
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables")
    operations: dict[str, OperationSpec] = Field(min_length=1)

    _base_dir: Path | None = PrivateAttr(default=None)

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        return check_name(name, "relic", dots=False)

    @field_validator("operations")
    @classmethod
    def _operation_names(cls, operations: dict[str, OperationSpec]) -> dict[str, OperationSpec]:
        for name in operations:
            if not PLAIN_NAME.match(name):
                raise ValueError(
                    f"{name!r} is not a valid operation name: start with a letter or '_', then "
                    "letters, digits, '_' or '-' (no dots)"
                )
        return operations

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        return check_env_names(env)

    @model_validator(mode="after")
    def _runtime_fields(self) -> RelicSpec:
        if self.runtime == "builtin":
            if self.command is not None:
                raise ValueError("command: runtime 'builtin' takes no command; remove it")
            return self
        if self.command is None:
            raise ValueError("command: runtime 'http' needs a command (the argv that starts it)")
        for index, arg in enumerate(self.command):
            for name in placeholders(arg, where=f"command[{index}]"):
                if name not in COMMAND_PLACEHOLDERS:
                    raise ValueError(
                        f"command[{index}]: unknown placeholder {{{name}}} in {arg!r} (known: "
                        f"{', '.join('{' + p + '}' for p in COMMAND_PLACEHOLDERS)})"
                    )
        for op_name, op in self.operations.items():
            where = f"operations.{op_name}.path"
            if op.path is None:
                raise ValueError(f"{where}: required for runtime 'http' (e.g. '/{op_name}')")
            properties = op.parameters.get("properties") or {}
            required = set(op.parameters.get("required") or ())
            for name in op.path_parameters:
                if name not in properties:
                    raise ValueError(
                        f"{where}: uses {{{name}}} but operations.{op_name}.parameters declares "
                        f"no property {name!r}; declare it under parameters.properties"
                    )
                if name not in required and "default" not in properties[name]:
                    raise ValueError(
                        f"{where}: uses {{{name}}}: list {name!r} in "
                        f"operations.{op_name}.parameters.required or give it a default"
                    )
        return self

    @property
    def base_dir(self) -> Path | None:
        """The directory of the manifest that declared it (the command's working directory)."""
        return self._base_dir


def check_relic(spec: RelicSpec) -> str | None:
    """Extra rule for user manifests (`Kind.check`)."""
    if spec.runtime == "builtin":
        return (
            "runtime: 'builtin' is reserved for the relics built into the worker "
            f"({', '.join(BUILTIN_RELICS)}); use http"
        )
    return None


def link_relic(spec: RelicSpec, path: Path) -> RelicSpec:
    """The spec remembering its manifest's directory: an http relic's command runs there."""
    linked = spec.model_copy()
    linked._base_dir = path.parent.resolve()
    return linked


# ---------------------------------------------------------------- built-in relics


def _object(properties: dict[str, Any], *required: str) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


_KEY = {"type": "string", "minLength": 1, "maxLength": 512}
_SQL = {"type": "string", "minLength": 1, "description": "one statement; values as ? or :name"}
_PARAMS = {"type": ["array", "object"],
           "description": "bound parameters: a list for ?, an object for :name"}

BUILTIN_RELICS: dict[str, RelicSpec] = {
    "kv": RelicSpec(
        name="kv", runtime="builtin",
        description="A key-value store in Redis, one namespace per agent ('documents' for "
                    "submitted documents). Values are any JSON.",
        idle_timeout_s=300.0,
        operations={
            "get": OperationSpec(
                description="Read a key: {key, found, value} (value null when not found).",
                parameters=_object({"key": _KEY}, "key")),
            "set": OperationSpec(
                description="Store a value under a key, optionally expiring after ttl seconds.",
                parameters=_object({"key": _KEY, "value": {},
                                    "ttl": {"type": "number", "exclusiveMinimum": 0}},
                                   "key", "value")),
            "delete": OperationSpec(
                description="Remove a key: {key, deleted}.",
                parameters=_object({"key": _KEY}, "key")),
            "list": OperationSpec(
                description="Keys starting with prefix, sorted: {keys, truncated}.",
                parameters=_object({"prefix": {"type": "string", "default": ""},
                                    "limit": {"type": "integer", "minimum": 1,
                                              "maximum": 1000, "default": 100}})),
        }),
    "sql": RelicSpec(
        name="sql", runtime="builtin",
        description="A SQLite database, one per agent ('documents' for submitted documents).",
        operations={
            "query": OperationSpec(
                description="Run one read-only statement (SELECT or WITH): the rows as "
                            "objects.",
                parameters=_object({"sql": _SQL, "params": _PARAMS,
                                    "max_rows": {"type": "integer", "minimum": 1,
                                                 "maximum": 10000, "default": 1000}},
                                   "sql")),
            "execute": OperationSpec(
                description="Run one statement that changes data or schema: "
                            "{rowcount, lastrowid}.",
                parameters=_object({"sql": _SQL, "params": _PARAMS}, "sql")),
        }),
}


def builtin_relics() -> dict[str, RelicSpec]:
    return dict(BUILTIN_RELICS)


# ---------------------------------------------------------------- naming an operation


@dataclass(frozen=True)
class Resolved:
    """An action's relic, operation and the operation's own parameters."""

    relic: RelicSpec
    operation: str
    spec: OperationSpec
    params: dict[str, Any]


def _split(relics: Mapping[str, RelicSpec], name: str) -> tuple[RelicSpec, str | None]:
    relic_name, dot, operation = name.partition(".")
    relic = relics.get(relic_name)
    if relic is None:
        known = ", ".join(sorted(relics)) or "none"
        raise RelicCallError("unknown_relic",
                             f"unknown relic {relic_name!r}; known relics: {known}")
    if dot and not operation:
        raise RelicCallError("unknown_operation", _missing_operation(relic))
    return relic, operation if dot else None


def _missing_operation(relic: RelicSpec) -> str:
    return (f"relic {relic.name!r}: say which operation to run, as name "
            f"'{relic.name}.<operation>' or parameters.operation (it has several: "
            f"{', '.join(sorted(relic.operations))})")


def _operation(relic: RelicSpec, operation: Any) -> OperationSpec:
    op = relic.operations.get(operation) if isinstance(operation, str) else None
    if op is None:
        raise RelicCallError(
            "unknown_operation",
            f"relic {relic.name!r} has no operation {operation!r}; its operations: "
            f"{', '.join(sorted(relic.operations))}")
    return op


def _split_params(relic: RelicSpec, operation: str | None,
                  params: Any) -> tuple[Any, dict[str, Any]]:
    """(the operation as given, its parameters)."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise RelicCallError("invalid_parameters",
                             f"relic {relic.name!r}: parameters must be an object, got "
                             f"{type(params).__name__}")
    if operation is not None:
        return operation, params
    if "operation" not in params:
        if len(relic.operations) == 1:  # a relic of one operation answers to its name alone
            return next(iter(relic.operations)), params
        raise RelicCallError("unknown_operation", _missing_operation(relic))
    rest = {k: v for k, v in params.items() if k != "operation"}
    return params["operation"], rest


def validate(relic: RelicSpec, operation: str, op: OperationSpec, params: dict[str, Any]) -> None:
    """RelicCallError naming the first bad parameter (JSON Schema Draft 2020-12)."""
    error = best_match(op.validator.iter_errors(params))
    if error is not None:
        raise RelicCallError("invalid_parameters",
                             f"relic {relic.name!r} operation {operation!r}: "
                             f"{describe_error(error)}")


def resolve(relics: Mapping[str, RelicSpec], name: str, params: Any) -> Resolved:
    """The relic and operation an action names, its parameters validated; RelicCallError."""
    relic, operation = _split(relics, name)
    given, rest = _split_params(relic, operation, params)
    op = _operation(relic, given)
    validate(relic, given, op, rest)
    return Resolved(relic, given, op, rest)


def check_relic_action(relics: Mapping[str, RelicSpec], name: str,
                       params: Any) -> list[tuple[str, str]]:
    """Problems known before running (documents): [(kind, message)].

    A `$` reference in the operation or in the parameters defers that check to run time.
    """
    try:
        relic, operation = _split(relics, name)
        given, rest = _split_params(relic, operation, params)
        if find_references(given):
            return []
        op = _operation(relic, given)
        if not find_references(rest):
            validate(relic, given, op, rest)
    except RelicCallError as exc:
        return [(exc.kind, str(exc))]
    return []
