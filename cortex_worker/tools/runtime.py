"""Run one tool call: validate the parameters, then dispatch on the tool's runtime."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import cortex_worker
from cortex_worker.sandbox.warm import RUNNER
from cortex_worker.tools import sandboxed
from cortex_worker.tools.attempt import running
from cortex_worker.tools.context import ToolContext
from cortex_worker.tools.errors import ToolError
from cortex_worker.tools.spec import ToolSpec, render_argv, validate_parameters

PACKAGE_ROOT = Path(cortex_worker.__file__).resolve().parent.parent
"""The directory holding `cortex_worker`, so the sandbox runner is importable."""

BuiltinFn = Callable[[dict[str, Any], ToolContext], Any]


def run_tool(
    spec: ToolSpec, params: dict[str, Any], ctx: ToolContext, module_paths: Sequence[Path] = ()
) -> Any:
    """The tool's result; raises ToolError (bad parameters, failure) or ToolTimeout.

    The time budget is `ctx.timeout`, capped by the tool's own `timeout` if it has one.
    `module_paths` go first on PYTHONPATH of python tools (the manifests directory). While
    it runs, `attempt.current()` answers the call's attempt (sandboxed tools: their environment).
    """
    validate_parameters(spec, params)
    if spec.timeout is not None and spec.timeout < ctx.timeout:
        ctx = dataclasses.replace(ctx, timeout=spec.timeout)
    with running(ctx.identity):
        return _dispatch(spec, params, ctx, module_paths)


def _dispatch(
    spec: ToolSpec, params: dict[str, Any], ctx: ToolContext, module_paths: Sequence[Path]
) -> Any:
    if spec.runtime == "builtin":
        return _builtin(spec, params, ctx)
    if spec.runtime == "python":
        return _python(spec, params, ctx, module_paths)
    if spec.runtime == "shell":
        return _shell(spec, params, ctx)
    if spec.runtime == "docker":
        return _docker(spec, params, ctx)
    if spec.runtime == "mcp":
        return _mcp(spec, params, ctx)
    raise ToolError(f"tool {spec.name!r}: unknown runtime {spec.runtime!r}")


def _mcp(spec: ToolSpec, params: dict[str, Any], ctx: ToolContext) -> Any:
    try:  # the MCP SDK loads where MCP tools run (the relic pool)
        from cortex_worker.services.mcp.tool_call import run_mcp_tool
    except ImportError as exc:
        raise ToolError(f"tool {spec.name!r} comes from an MCP server, and this worker cannot "
                        f"run MCP tools ({exc}): pip install 'cortex[mcp]'") from exc
    return run_mcp_tool(spec, params, ctx)


def _builtin(spec: ToolSpec, params: dict[str, Any], ctx: ToolContext) -> Any:
    if spec.entrypoint is None:
        raise ToolError(f"there is no built-in tool {spec.name!r}")
    return builtin_function(spec.entrypoint)(params, ctx)


@cache
def builtin_function(entrypoint: str) -> BuiltinFn:
    """The `module:function` of a built-in tool, imported on its first call in this process."""
    module, _, name = entrypoint.partition(":")
    function: BuiltinFn = getattr(importlib.import_module(module), name)
    return function


def _python(
    spec: ToolSpec, params: dict[str, Any], ctx: ToolContext, module_paths: Sequence[Path]
) -> Any:
    assert spec.entrypoint is not None
    paths = [str(Path(p).resolve()) for p in module_paths] + [str(PACKAGE_ROOT)]
    env = {
        **spec.env,
        "PYTHONPATH": os.pathsep.join(paths),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
    }
    line = sandboxed.run_json(
        # -P: the workspace (cwd) is not put on sys.path; -s: no user site in HOME (= workspace)
        [sys.executable, "-P", "-s", "-m", RUNNER, spec.entrypoint],
        ctx,
        limits=spec.limits,
        stdin=json.dumps(params).encode("utf-8"),
        env=env,
        network=spec.network == "host",
        reads=[Path(p) for p in paths],
        warm=True,  # forked from a zygote that imported the module (cortex_worker/sandbox/warm.py)
    )
    return line.get("result")


def _shell(spec: ToolSpec, params: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    argv = render_argv(spec, params)
    result = sandboxed.run(argv, ctx, limits=spec.limits, env=spec.env,
                           network=spec.network == "host",
                           reads=[Path(argv[0])] if os.path.isabs(argv[0]) else [])
    stdout = result.stdout.decode("utf-8", errors="replace")
    stderr = result.stderr.decode("utf-8", errors="replace")
    if result.returncode != 0:
        raise ToolError(
            f"{argv[0]} exited with status {result.returncode}: "
            f"{sandboxed.tail(result.stderr, 500) or 'no error output'}",
            detail=sandboxed.tail(result.stderr),
        )
    return {"returncode": result.returncode, "stdout": stdout, "stderr": stderr}


def _docker(spec: ToolSpec, params: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    from cortex_worker.sandbox import docker  # the Docker SDK loads where docker tools run

    argv = render_argv(spec, params)
    result = docker.run_container(spec, argv, ctx)
    if result.exit_code != 0:
        raise ToolError(
            f"the container ({spec.image}) exited with status {result.exit_code}"
            f"{result.why(spec)}: {docker.tail(result.stderr, 500) or 'no error output'}",
            detail=docker.tail(result.stderr),
        )
    return {
        "exit_code": result.exit_code,
        "stdout": result.stdout.decode("utf-8", errors="replace"),
        "stderr": result.stderr.decode("utf-8", errors="replace"),
    }
