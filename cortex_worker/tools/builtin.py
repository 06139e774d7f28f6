"""What the built-in tools do: one `fn(params, ctx)` each, named by its spec's `entrypoint`.

`ctx` (`ToolContext`) says which attempt of which action runs: `ctx.attempt`, and
`ctx.idempotency_key`, the same on every attempt, for side effects that must happen once.

Their specs are data in `cortex_worker.tools.spec.BUILTIN_TOOLS`; a worker imports this module
when it first runs one (`cortex_worker.tools.runtime`), so loading manifests never does.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from cortex_worker.sandbox.function_main import parse_last_line
from cortex_worker.sandbox.warm import RUNNER
from cortex_worker.tools import calculator, files, http, sandboxed
from cortex_worker.tools.context import ToolContext
from cortex_worker.tools.errors import ToolTimeout
from cortex_worker.tools.spec import Limits

SNIPPET = [sys.executable, "-I", "-m", RUNNER, "cortex_worker.sandbox.snippet:execute"]
"""The snippet's command: the python runner, as a `@tool` function's, so that it runs warm.
`-I` as ever: no PYTHON* variables, user site or workspace on the path at start-up."""
PYTHON_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
"""For what the snippet starts: `-I` has its own interpreter ignore them."""
PYTHON_LIMITS = Limits()


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
    """Run a snippet in a sandboxed `python -I`, in the workspace, forked from a warm runner
    (cortex_worker/sandbox/snippet.py): the runner's result is the snippet's result line."""
    result = sandboxed.run(
        SNIPPET,
        ctx,
        limits=PYTHON_LIMITS,
        stdin=json.dumps({"code": params["code"]}).encode("utf-8"),
        env=PYTHON_ENV,
        warm=True,
    )
    runner = sandboxed.answer(result, parse_last_line(result.stdout))
    line = sandboxed.answer(result, runner.get("result"))
    return {"stdout": line.get("stdout", ""), "result": line.get("result")}


# ---------------------------------------------------------------- http_get


def http_get(params: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    return http.http_get(
        params["url"],
        allow_hosts=ctx.settings.http_allow_hosts,
        timeout=min(ctx.timeout, 60.0),
        headers=params.get("headers"),
        max_bytes=params.get("max_bytes", ctx.settings.max_output_bytes),
        idempotency_key=ctx.idempotency_key,
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
