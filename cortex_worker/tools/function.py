"""Tools written as Python functions: `@tool`, as a Celery user writes `@app.task`.

    from cortex_worker.tools.function import tool

    @tool(timeout=30)
    async def search(query: str, limit: int = 5) -> list[str]:
        \"\"\"Search the catalogue; returns titles.\"\"\"

The parameters' JSON Schema comes from the type hints (pydantic models included), the
description from the docstring. Modules of such functions are named in `CORTEX_TOOL_MODULES`
or a `kind: ToolModule` manifest; `discover` reads them into `ToolSpec`s (runtime `python`,
entrypoint `module:function`), so they run in the same sandbox, with the same validation, as
YAML tools, and are listed by `GET /v1/tools` and in agent prompts alike. In the sandbox the
runner calls the `FunctionTool`, which validates the parameters into the annotated types.

A function that must not repeat a side effect when its action runs again asks which attempt
it is, as built-ins read their `ctx`:

    from cortex_worker.tools.attempt import current

    @tool
    def charge(card: str, cents: int) -> str:
        key = current().idempotency_key  # the same on every attempt; current().attempt counts
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any, overload

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from cortex_worker.tools.errors import ToolError
from cortex_worker.tools.spec import Limits, ToolSpec

__all__ = ["FunctionTool", "discover", "tool"]


class FunctionTool:
    """A function declared as a tool. Calling it validates keyword parameters against its
    signature (coercing them into pydantic models and the like) and calls the function."""

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None,
                 description: str | None = None, timeout: float | None = None,
                 limits: Limits | None = None, network: bool = False) -> None:
        """`network`: may reach the network (tools have none by default)."""
        self.fn = fn
        self.name = name or fn.__name__
        self.description = description if description is not None else _summary(fn)
        self.timeout, self.limits, self.network = timeout, limits, network
        self.model = _parameters_model(fn)
        self.__doc__, self.__name__, self.__wrapped__ = fn.__doc__, fn.__name__, fn

    def __call__(self, **params: Any) -> Any:
        try:
            values = self.model.model_validate(params)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "parameters"
            raise ToolError(f"{where}: {first['msg']}") from None
        return self.fn(**{name: getattr(values, name) for name in type(values).model_fields})

    def spec(self, entrypoint: str) -> ToolSpec:
        """The tool's spec; `entrypoint` is where the sandbox finds it (`module:attribute`)."""
        schema = _untitled(self.model.model_json_schema())
        fields: dict[str, Any] = {"name": self.name, "description": self.description,
                                  "runtime": "python", "entrypoint": entrypoint,
                                  "parameters": schema}
        if self.network:
            fields["network"] = "host"
        if self.timeout is not None:
            fields["timeout"] = self.timeout
        if self.limits is not None:
            fields["limits"] = self.limits
        return ToolSpec.model_validate(fields)


@overload
def tool(fn: Callable[..., Any], /) -> FunctionTool: ...
@overload
def tool(*, name: str | None = None, description: str | None = None,
         timeout: float | None = None, limits: Limits | None = None,
         network: bool = False) -> Callable[[Callable[..., Any]], FunctionTool]: ...


def tool(fn: Callable[..., Any] | None = None, /, *, name: str | None = None,
         description: str | None = None, timeout: float | None = None,
         limits: Limits | None = None, network: bool = False) -> Any:
    """Declare a function (sync or async) as a tool: `@tool` or `@tool(timeout=...)`."""
    def wrap(function: Callable[..., Any]) -> FunctionTool:
        return FunctionTool(function, name=name, description=description, timeout=timeout,
                            limits=limits, network=network)
    return wrap(fn) if fn is not None else wrap


def discover(module_name: str) -> list[ToolSpec]:
    """The tools a module declares with `@tool`, in definition order. Importing it runs its
    top level (in the process that loads the registry); it must be importable (the manifests
    directory is on the path)."""
    module = importlib.import_module(module_name)
    return [value.spec(f"{module_name}:{attribute}")
            for attribute, value in vars(module).items() if isinstance(value, FunctionTool)]


def _untitled(schema: Any) -> Any:
    """The schema without pydantic's generated `title`s (noise in a prompt); a property
    named `title` stays."""
    if isinstance(schema, list):
        return [_untitled(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in ("properties", "$defs"):
            out[key] = {name: _untitled(sub) for name, sub in value.items()}
        else:
            out[key] = _untitled(value)
    return out


def _summary(fn: Callable[..., Any]) -> str:
    """The docstring's first paragraph, on one line."""
    doc = inspect.getdoc(fn) or ""
    return " ".join(doc.split("\n\n", 1)[0].split())


def _parameters_model(fn: Callable[..., Any]) -> type[BaseModel]:
    """A pydantic model of the function's keyword parameters, from its type hints."""
    signature = inspect.signature(fn, eval_str=True)
    fields: dict[str, Any] = {}
    for parameter in signature.parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD,
                              parameter.POSITIONAL_ONLY):
            raise TypeError(f"tool {fn.__name__!r}: parameter {parameter.name!r} must be "
                            "nameable in JSON (no *args, **kwargs or positional-only)")
        annotation = Any if parameter.annotation is parameter.empty else parameter.annotation
        default = ... if parameter.default is parameter.empty else parameter.default
        fields[parameter.name] = (annotation, default)
    return create_model(f"{fn.__name__}_parameters", __config__=ConfigDict(extra="forbid"),
                        **fields)
