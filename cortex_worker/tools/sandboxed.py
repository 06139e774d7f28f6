"""Run a tool process in the sandbox and turn what happened into a result or a ToolError."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cortex_worker.sandbox.limits import Limits
from cortex_worker.sandbox.process import SandboxError, SandboxResult, run_sandboxed
from cortex_worker.sandbox.runner import parse_last_line
from cortex_worker.tools.context import ToolContext
from cortex_worker.tools.errors import ToolError, ToolTimeout

STDERR_TAIL = 2000

_KILLED = {
    "cpu_limit": "it used up its CPU time limit",
    "file_limit": "it wrote a file larger than its file size limit",
    "shutdown": "the worker is shutting down",
}


def run(
    argv: Sequence[str],
    ctx: ToolContext,
    *,
    limits: Limits,
    stdin: bytes | None = None,
    env: Mapping[str, str] | None = None,
    network: bool = False,
) -> SandboxResult:
    """run_sandboxed in the workspace with the context's timeout; raises ToolTimeout/ToolError.
    Without `network` the process gets no network at all."""
    try:
        result = run_sandboxed(
            argv, stdin=stdin, cwd=ctx.workspace, timeout=ctx.timeout, limits=limits, env=env,
            isolate_network=not network,
        )
    except SandboxError as exc:
        raise ToolError(str(exc)) from None
    if result.timed_out:
        raise ToolTimeout(f"timed out after {ctx.timeout:g}s", detail=tail(result.stderr))
    if result.killed_by is not None:
        why = _KILLED.get(result.killed_by, f"it was killed by {result.killed_by}")
        raise ToolError(f"the tool process was stopped: {why}", detail=tail(result.stderr))
    return result


def run_json(
    argv: Sequence[str],
    ctx: ToolContext,
    *,
    limits: Limits,
    stdin: bytes,
    env: Mapping[str, str] | None = None,
    network: bool = False,
) -> dict[str, Any]:
    """Run a runner/snippet program and return its successful result line.

    A failure line becomes ToolError("<type>: <error>") with the stderr tail as detail.
    """
    result = run(argv, ctx, limits=limits, stdin=stdin, env=env, network=network)
    line = parse_last_line(result.stdout)
    if line is None:
        if result.stdout_truncated:
            raise ToolError(f"the tool wrote more than {len(result.stdout)} bytes to stdout")
        raise ToolError(
            f"the tool process exited with status {result.returncode} without a result: "
            f"{tail(result.stderr, 500) or 'no error output'}",
            detail=tail(result.stderr),
        )
    if not line.get("ok"):
        error = str(line.get("error") or "failed")
        kind = line.get("type")
        message = error if not kind or error.startswith(f"{kind}:") else f"{kind}: {error}"
        raise ToolError(message, detail=tail(result.stderr))
    return line


def tail(data: bytes, limit: int = STDERR_TAIL) -> str:
    """The last `limit` characters of a process output, decoded."""
    text = data.decode("utf-8", errors="replace").strip()
    return text if len(text) <= limit else "…" + text[-limit:]
