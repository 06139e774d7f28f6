"""The tools built into every worker: `BUILTINS[name] = (spec, fn)`, `fn(params, ctx)`."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cortex_worker.sandbox.limits import Limits
from cortex_worker.tools import calculator, files, http, sandboxed
from cortex_worker.tools.context import ToolContext
from cortex_worker.tools.errors import ToolTimeout
from cortex_worker.tools.spec import ToolSpec

BuiltinFn = Callable[[dict[str, Any], ToolContext], Any]

SNIPPET = Path(__file__).resolve().parent.parent / "sandbox" / "snippet.py"
PYTHON_LIMITS = Limits()


def _spec(name: str, description: str, parameters: dict[str, Any], **extra: Any) -> ToolSpec:
    return ToolSpec(
        name=name, description=description, runtime="builtin", parameters=parameters, **extra
    )


def _object(
    properties: dict[str, Any], required: tuple[str, ...] = (), **extra: Any
) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": list(required)}
    schema.setdefault("additionalProperties", False)
    schema.update(extra)
    return schema


# ---------------------------------------------------------------- echo, sleep, calculator


def echo(params: dict[str, Any], ctx: ToolContext) -> Any:
    """`message` if given, else the whole parameters object."""
    return params.get("message", params)


def sleep(params: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    """Sleep `seconds`; longer than the action's timeout sleeps the timeout, then times out."""
    seconds = float(params["seconds"])
    time.sleep(min(seconds, ctx.timeout))
    if seconds > ctx.timeout:
        raise ToolTimeout(f"timed out after {ctx.timeout:g}s (asked to sleep {seconds:g}s)")
    return {"slept": params["seconds"]}


def calculate(params: dict[str, Any], ctx: ToolContext) -> int | float:
    return calculator.evaluate(params["expression"])


# ---------------------------------------------------------------- python


def python(params: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    """Run a snippet in a sandboxed `python -I`, in the workspace."""
    line = sandboxed.run_json(
        [sys.executable, "-I", str(SNIPPET)],
        ctx,
        limits=PYTHON_LIMITS,
        stdin=params["code"].encode("utf-8"),
        env={"PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"},
    )
    return {"stdout": line.get("stdout", ""), "result": line.get("result")}


# ---------------------------------------------------------------- http_get


def http_get(params: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    return http.http_get(
        params["url"],
        allow_hosts=ctx.settings.http_allow_hosts,
        timeout=min(ctx.timeout, 60.0),
        headers=params.get("headers"),
        max_bytes=params.get("max_bytes", ctx.settings.max_output_bytes),
    )


# ---------------------------------------------------------------- workspace files


def read_file(params: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    return files.read_text(
        ctx.workspace, params["path"], params.get("max_bytes", ctx.settings.max_output_bytes)
    )


def write_file(params: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    return files.write_text(
        ctx.workspace, params["path"], params["content"], params.get("append", False)
    )


def grep(params: dict[str, Any], ctx: ToolContext) -> list[dict[str, Any]]:
    return files.grep(
        ctx.workspace,
        params["pattern"],
        params.get("path", "."),
        params.get("max_matches", 100),
        params.get("ignore_case", False),
    )


# ---------------------------------------------------------------- the table

_PATH = {"type": "string", "minLength": 1, "description": "relative to the job workspace"}
_MAX_BYTES = {"type": "integer", "minimum": 1, "maximum": 16 * 1024 * 1024}

BUILTINS: dict[str, tuple[ToolSpec, BuiltinFn]] = {
    "echo": (
        _spec(
            "echo",
            "Return `message`, or the whole parameters object when there is no `message`.",
            {"type": "object", "properties": {"message": {"description": "any JSON value"}}},
        ),
        echo,
    ),
    "sleep": (
        _spec(
            "sleep",
            "Sleep for `seconds` (at most the action's timeout) and return {slept}.",
            _object({"seconds": {"type": "number", "minimum": 0}}, ("seconds",)),
            returns=_object({"slept": {"type": "number"}}),
        ),
        sleep,
    ),
    "calculator": (
        _spec(
            "calculator",
            "Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses, "
            "sqrt log log10 log2 exp sin cos tan floor ceil abs round min max, pi e tau.",
            _object(
                {
                    "expression": {
                        "type": "string",
                        "minLength": 1,
                        "maxLength": calculator.MAX_LENGTH,
                    }
                },
                ("expression",),
            ),
            returns={"type": "number"},
        ),
        calculate,
    ),
    "python": (
        _spec(
            "python",
            "Run a Python snippet in a sandbox in the job workspace; returns what it printed "
            "and the value of its last expression.",
            _object({"code": {"type": "string", "minLength": 1}}, ("code",)),
            returns=_object({"stdout": {"type": "string"}, "result": {}}),
        ),
        python,
    ),
    "http_get": (
        _spec(
            "http_get",
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
        http_get,
    ),
    "read_file": (
        _spec(
            "read_file",
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
        read_file,
    ),
    "write_file": (
        _spec(
            "write_file",
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
        write_file,
    ),
    "grep": (
        _spec(
            "grep",
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
        grep,
    ),
}


def builtin_specs() -> dict[str, ToolSpec]:
    """name → spec of every built-in tool."""
    return {name: spec for name, (spec, _) in BUILTINS.items()}
