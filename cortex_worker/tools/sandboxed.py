"""Run a tool process in the sandbox and turn what happened into a result or a ToolError."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from cortex_worker.sandbox import isolation
from cortex_worker.sandbox.function_main import parse_last_line
from cortex_worker.sandbox.isolation import Isolation
from cortex_worker.sandbox.process import SandboxError, SandboxResult, run_sandboxed
from cortex_worker.sandbox.warm import run_warm
from cortex_worker.settings import Settings
from cortex_worker.tools.context import ToolContext, tool_user
from cortex_worker.tools.errors import ToolError, ToolTimeout
from cortex_worker.tools.spec import Limits

log = logging.getLogger(__name__)

STDERR_TAIL = 2000

_KILLED = {
    "cpu_limit": "it used up its CPU time limit",
    "file_limit": "it wrote a file larger than its file size limit",
    "shutdown": "the worker is shutting down",
}


def isolation_for(ctx: ToolContext, *, network: bool = False,
                  reads: Sequence[Path] = ()) -> Isolation | None:
    """The namespaces a tool of this context runs in (None: `sandbox_isolation` is off, or
    'auto' on a kernel that refuses them); raises ToolError when 'required' cannot be met."""
    mode = ctx.settings.sandbox_isolation
    if mode == "off":
        return None
    reason = isolation.unavailable_reason()
    if reason is not None:
        if mode == "required":
            raise ToolError(
                f"tools must run isolated (CORTEX_SANDBOX_ISOLATION=required) but this worker "
                f"cannot create namespaces: {reason}. Run it as root, allow unprivileged user "
                "namespaces, or give its container CAP_SYS_ADMIN and an unconfined seccomp "
                "profile (docs/security.md)")
        _warn_once(reason)
        return None
    readable = (*isolation.interpreter_paths(), *(Path(p) for p in reads))
    root = ctx.settings.workspace_root.expanduser().resolve()
    hide = root if ctx.workspace.parent == root and not any(
        p.resolve().is_relative_to(root) for p in readable) else None
    return Isolation(writable=ctx.workspace, hide=hide, readable=readable, network=not network,
                     user=tool_user(ctx.settings))


def describe_isolation(settings: Settings) -> tuple[bool, str]:
    """(whether tools may run, a line saying how they are isolated), for a tool worker's
    start-up: `required` without namespaces may not run."""
    mode = settings.sandbox_isolation
    if mode == "off":
        return True, "tool sandbox: namespaces off (CORTEX_SANDBOX_ISOLATION=off)"
    reason = isolation.unavailable_reason()
    if reason is not None:
        line = f"tool sandbox: NO namespaces here ({reason})"
        if mode == "required":
            return False, line + "; CORTEX_SANDBOX_ISOLATION=required: not starting"
        return True, line + "; tools see the worker's processes, files and network"
    user = tool_user(settings)
    who = f"uid {user[0]} ({settings.sandbox_user})" if user else \
        f"uid {os.geteuid()} without capabilities"
    return True, ("tool sandbox: own PID, mount, IPC, UTS and (unless `network: host`) "
                  "network namespaces, read-only "
                  f"filesystem but the job workspace; tools run as {who}")


@cache
def _warn_once(reason: str) -> None:
    log.warning("tools run WITHOUT namespaces on this worker (CORTEX_SANDBOX_ISOLATION=auto): "
                "they can see its processes, write where it may and use the network: %s", reason)


def run(
    argv: Sequence[str],
    ctx: ToolContext,
    *,
    limits: Limits,
    stdin: bytes | None = None,
    env: Mapping[str, str] | None = None,
    network: bool = False,
    reads: Sequence[Path] = (),
    warm: bool = False,
) -> SandboxResult:
    """run_sandboxed in the workspace with the context's timeout; raises ToolTimeout/ToolError.
    Without `network` the process gets no network at all; `reads` are paths it must read.
    `warm`: `argv` is the python runner's command, run from a warm runner (`run_warm`).
    The environment is `env` and the call's attempt (`ToolContext.identity.env()`)."""
    isolated = isolation_for(ctx, network=network, reads=reads)
    attempt = ctx.identity.env()
    try:
        if warm:  # the attempt is the call's own: not part of the warm runner's environment
            result = run_warm(argv, stdin=stdin, cwd=ctx.workspace, timeout=ctx.timeout,
                              limits=limits, env=env, call_env=attempt, isolation=isolated)
        else:
            result = run_sandboxed(argv, stdin=stdin, cwd=ctx.workspace, timeout=ctx.timeout,
                                   limits=limits, env={**(env or {}), **attempt},
                                   isolation=isolated)
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
    reads: Sequence[Path] = (),
    warm: bool = False,
) -> dict[str, Any]:
    """Run a runner program and return its successful result line.

    A failure line becomes ToolError("<type>: <error>") with the stderr tail as detail.
    """
    result = run(argv, ctx, limits=limits, stdin=stdin, env=env, network=network, reads=reads,
                 warm=warm)
    return answer(result, parse_last_line(result.stdout))


def answer(result: SandboxResult, line: dict[str, Any] | None) -> dict[str, Any]:
    """`line`, the result line `result` carried, if it says ok; else its ToolError. Apart from
    `run_json` so that a line inside a runner's result (the `python` built-in's snippet) fails
    with the same messages as a runner's own line."""
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
