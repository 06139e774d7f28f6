"""Runs a Python snippet (the `python` built-in): `execute(code)`, through the python runner.

The tool calls `python -I -m cortex_worker.sandbox.function_main
cortex_worker.sandbox.snippet:execute` with `{"code": ...}` on stdin, from a warm runner
(cortex_worker/sandbox/warm.py: a zygote that imported this module forks one process per
call, so a call pays for a fork, not for an interpreter's start-up; the cold runner where no
zygote can serve). The runner's result is the snippet's own result line:

    {"ok": true, "result": ..., "stdout": "<what the snippet printed>"}
    {"ok": false, "error": "<the traceback's last line>", "type": "...", "stdout": "..."}

A failing snippet is a result here, not an exception, so that its error reads as the
traceback's last line (`describe`), not as a failure of the runner. The snippet runs in a
fresh `__main__` namespace; if its last statement is an expression, that value is the result
(kept as is if JSON-able, else its repr). The full traceback goes to stderr. The working
directory (the job workspace) is appended to `sys.path`, so modules written there can be
imported. Stdlib only: the zygote's process, which every call is a copy of, stays small.
"""

from __future__ import annotations

import ast
import builtins
import io
import json
import os
import sys
import traceback
from typing import Any

MAX_STDOUT = 1024 * 1024
FILENAME = "<snippet>"


class _Capped(io.TextIOBase):
    """A text sink that keeps the first MAX_STDOUT characters and counts the rest."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.size = 0
        self.dropped = 0

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        room = MAX_STDOUT - self.size
        if room > 0:
            self.parts.append(text[:room])
            self.size += min(len(text), room)
        self.dropped += max(len(text) - max(room, 0), 0)
        return len(text)

    @property
    def text(self) -> str:
        tail = f"\n[... {self.dropped} more characters not kept]" if self.dropped else ""
        return "".join(self.parts) + tail


def run(code: str) -> Any:
    """Execute `code`; return the value of its last statement if that is an expression."""
    tree = ast.parse(code, FILENAME)
    last: ast.Expression | None = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(tree, FILENAME, "exec"), namespace)
    return eval(compile(last, FILENAME, "eval"), namespace) if last is not None else None


def jsonable(value: Any) -> Any:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return repr(value)
    return value


def describe(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError):
        return f"{type(exc).__name__}: {exc.msg} (line {exc.lineno})"
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


def execute(code: str) -> dict[str, Any]:
    """Run the snippet `code`: its result line (see the module docstring)."""
    sys.path.append(os.getcwd())
    real_stdout = sys.stdout
    captured = _Capped()
    sys.stdout = captured
    try:
        value = run(code)
    except (Exception, SystemExit) as exc:
        sys.stdout = real_stdout
        traceback.print_exception(exc, file=sys.stderr)
        line = {"ok": False, "error": describe(exc), "type": type(exc).__name__}
    else:
        sys.stdout = real_stdout
        line = {"ok": True, "result": jsonable(value)}
    line["stdout"] = captured.text
    return line
