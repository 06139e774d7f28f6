"""Entry point of python-runtime tools: `python -m cortex_worker.sandbox.function_main module:function`.

Reads a JSON object of parameters on stdin, imports `module`, calls `function(**params)`
(awaiting it if it is a coroutine function) and writes ONE JSON line as the LAST line of
stdout:

    {"ok": true, "result": <JSON>, "stdout": "<what the function printed>"}
    {"ok": false, "error": "<message>", "type": "<exception class>", "stdout": "..."}

What the function prints still goes to stdout, before that line; the traceback of a failure
goes to stderr. Once the line is out, stdout and stderr are ended (pointed at /dev/null): the
worker, which waits for their end, has the answer then, not once this process has exited (an
exit costs about 1.5 ms forked from a warm zygote, an interpreter's shutdown far more); what
is written after it, by atexit handlers say, is dropped. Stderr ends just before the line is
written and stdout right after it, so the worker reads the line and the end in one wake. That exit then runs at the lowest
priority (nice 19): the worker, woken by the answer, often shares this process's CPU and would
otherwise wait for the exit to finish. The module is found through
PYTHONPATH, which the caller sets. Stdlib only: this runs in every tool process and must
start fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import inspect
import io
import json
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any, TextIO

ENTRYPOINT = re.compile(
    r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
)
MAX_CAPTURED_STDOUT = 64 * 1024
"""What the function printed, kept in the result line (it also went to stdout, in full)."""


class _Tee(io.TextIOBase):
    """Writes through to the real stdout and keeps the first MAX_CAPTURED_STDOUT characters."""

    def __init__(self, real: TextIO) -> None:
        self.real = real
        self.kept: list[str] = []
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.real.write(text)
        if self.size < MAX_CAPTURED_STDOUT:
            piece = text[: MAX_CAPTURED_STDOUT - self.size]
            self.kept.append(piece)
            self.size += len(piece)
        return len(text)

    def flush(self) -> None:
        self.real.flush()

    @property
    def text(self) -> str:
        return "".join(self.kept)


def load(entrypoint: str) -> Callable[..., Any]:
    """Import `module:function` and return the function."""
    if not ENTRYPOINT.match(entrypoint):
        raise ValueError(f"entrypoint must look like 'module:function', got {entrypoint!r}")
    module_name, _, attr = entrypoint.partition(":")
    module = importlib.import_module(module_name)
    try:
        fn = getattr(module, attr)
    except AttributeError:
        raise AttributeError(f"module {module_name!r} has no function {attr!r}") from None
    if not callable(fn):
        raise TypeError(f"{entrypoint} is not callable")
    return fn


def call(fn: Callable[..., Any], params: dict[str, Any]) -> Any:
    """Call with `**params`; await coroutines."""
    result = fn(**params)
    if inspect.isawaitable(result):
        result = asyncio.run(_await(result))
    return result


async def _await(awaitable: Any) -> Any:
    return await awaitable


def to_json(value: Any) -> Any:
    """Pydantic models and dataclasses become dicts; anything else must already be JSON."""
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def main(argv: list[str] | None = None) -> int:
    """Run the tool once; always exit 0 with a result line (the line says whether it failed)."""
    argv = sys.argv[1:] if argv is None else argv
    real_stdout = sys.stdout
    tee = _Tee(real_stdout)
    try:
        if len(argv) != 1:
            raise ValueError("usage: python -m cortex_worker.sandbox.function_main module:function")
        fn = load(argv[0])
        params = json.loads(sys.stdin.read() or "{}")
        if not isinstance(params, dict):
            raise TypeError(f"parameters must be a JSON object, got {type(params).__name__}")
        sys.stdout = tee
        try:
            result = call(fn, params)
        finally:
            sys.stdout = real_stdout
    except (Exception, SystemExit) as exc:
        encoded = _failure(exc, tee)
    else:
        try:
            line = {"ok": True, "result": to_json(result), "stdout": tee.text}
            encoded = json.dumps(line, allow_nan=False)
        except (TypeError, ValueError) as exc:
            encoded = _failure(exc, tee, f"the tool's result is not JSON-serializable: {exc}")
    sys.stderr.flush()
    _end(2)  # nothing more goes to stderr: its end reaches the worker before the answer
    # a newline first: the tool may have written to fd 1 directly, without one
    real_stdout.write("\n" + encoded + "\n")
    real_stdout.flush()
    _end(1)
    with contextlib.suppress(OSError):  # what is left is the exit: 1-3 ms of tearing memory down
        os.nice(19)  # step aside for the worker that reads the answer (module docstring)
    return 0


def _end(fd: int) -> None:
    """End output `fd` for its reader: point it at /dev/null, or close it if there is none
    here (later writes then fail, and nobody reads them)."""
    try:
        sink = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        os.close(fd)
        return
    os.dup2(sink, fd)
    os.close(sink)


def _failure(exc: BaseException, tee: _Tee, message: str | None = None) -> str:
    traceback.print_exception(exc, file=sys.stderr)
    if message is None:
        message = (
            f"the tool called sys.exit({exc.code!r})" if isinstance(exc, SystemExit) else str(exc)
        )
    line = {"ok": False, "error": message, "type": type(exc).__name__, "stdout": tee.text}
    return json.dumps(line, default=repr)


def parse_last_line(stdout: bytes) -> dict[str, Any] | None:
    """The result line a runner wrote last on stdout, or None if there is none."""
    lines = stdout.rstrip(b"\n").rsplit(b"\n", 1)
    try:
        value = json.loads(lines[-1])
    except ValueError:
        return None
    return value if isinstance(value, dict) and "ok" in value else None


if __name__ == "__main__":
    sys.exit(main())
