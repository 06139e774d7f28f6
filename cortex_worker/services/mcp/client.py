"""The MCP client side: start a stdio server, connect (stdio or streamable HTTP), list tools,
call one; built on the official MCP SDK (`mcp`, asyncio) from threads.

- `list_tools(servers)`: each server's `tools/list`, for the manifest loader (through
  `listing.SharedListing` in the API and the workers: one listing for the cluster). A stdio
  server is started for this only (in the directory of its manifest, with the same environment
  as in the relic pool) and stopped; the answer is kept for the life of the process, so
  loading the manifests again does not start it again.
- `launch(spec, home, stderr)`: `Popen` of a stdio server in its own session (process group)
  with a minimal environment: PATH (the worker's Python's directory first), LANG, HOME =
  TMPDIR = `home`, and the manifest's `env`. Its stdout and stdin carry MCP; stderr is its log.
- `Connection`: one initialized session, held open by a task of the process's MCP event loop
  (one thread, started on first use); `call`, `ping` and `close` are called from any thread.
  A call's timeout and a cancelled action both reach the server as `notifications/cancelled`.
  A call made for an action (`tools.attempt.current()`) carries its attempt in `_meta`
  (`IDEMPOTENCY_KEY_META`, `ATTEMPT_META`), so a server can deduplicate a side effect.

The process's lifecycle (first use, health, restart, idle stop) is `cortex_worker.services.mcp.manager`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import anyio
import mcp_types as types
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage

from cortex_worker.services.mcp.spec import (
    MCPServerSpec,
    command_argv,
    config_key,
    server_env,
    server_headers,
)
from cortex_worker.services.pool import STOP_GRACE_S, kill_group, unreaped
from cortex_worker.services.relics.manager import RELIC_PATH
from cortex_worker.tools.attempt import current
from cortex_worker.tools.errors import ToolError, ToolTimeout

log = logging.getLogger(__name__)

CLIENT_INFO = types.Implementation(name="cortex", version="0.1.0")
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""The longest line a stdio server may send (one JSON-RPC message)."""
CANCEL_POLL_S = 0.5
"""How often a waiting call asks whether its action was cancelled."""
CALL_GRACE_S = 2.0
"""Past its timeout, how long a call waits for the SDK to report it before giving up."""
EXIT_GRACE_S = 1.0
"""After its stdin closes, how long a stdio server has to exit before SIGTERM."""
LOG_TAIL_BYTES = 2000
IDEMPOTENCY_KEY_META = "io.cortex/idempotency_key"
"""`_meta` key of a tools/call: the action's key, the same on every attempt."""
ATTEMPT_META = "io.cortex/attempt"
"""`_meta` key of a tools/call: the action's attempt, 1 on its first run."""

Cancelled = Callable[[], str | None]
"""Asked while a call waits: why the action no longer needs its result, or None."""


class ConnectionLost(ToolError):
    """The connection to the server closed (a stdio server that exited, mostly)."""


def attempt_meta() -> types.RequestParamsMeta | None:
    """The `_meta` of a tools/call made for an action's attempt (None outside one): read in
    the calling thread, where `tools.runtime.run_tool` set it."""
    try:
        attempt = current()
    except LookupError:
        return None
    return {IDEMPOTENCY_KEY_META: attempt.idempotency_key,
            ATTEMPT_META: attempt.attempt}


# ---------------------------------------------------------------- the event loop thread

class _LoopThread:
    """The process's MCP event loop, running in a daemon thread (started on first use, and
    again in a forked child or after it stopped)."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pid = 0
        self.lock = threading.Lock()

    def get(self) -> asyncio.AbstractEventLoop:
        with self.lock:
            if self.loop is None or self.pid != os.getpid() or not self.loop.is_running():
                loop = asyncio.new_event_loop()
                started = threading.Event()
                loop.call_soon(started.set)
                threading.Thread(target=loop.run_forever, name="mcp-client", daemon=True).start()
                started.wait(10)
                self.loop, self.pid = loop, os.getpid()
            return self.loop


_loop_thread = _LoopThread()


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's MCP event loop, running in a daemon thread (started on first use)."""
    return _loop_thread.get()


# ---------------------------------------------------------------- starting a stdio server


def process_env(spec: MCPServerSpec, home: Path) -> dict[str, str]:
    """The whole environment of a stdio server: nothing of the worker's is inherited."""
    dirs = [str(Path(sys.executable).parent), *RELIC_PATH.split(os.pathsep)]
    path = os.pathsep.join(dict.fromkeys(dirs))
    return {"PATH": path, "LANG": "C.UTF-8", "HOME": str(home), "TMPDIR": str(home),
            **server_env(spec)}


def launch(spec: MCPServerSpec, home: Path, stderr: IO[bytes] | int) -> subprocess.Popen[bytes]:
    """Start a stdio server (its own process group); ToolError if it cannot be started."""
    argv = command_argv(spec, sys.executable)
    env = process_env(spec, home)
    cwd = spec.workdir
    if not cwd.is_dir():
        raise ToolError(f"MCP server {spec.name!r} cannot start: its directory {str(cwd)!r} "
                        "(cwd, relative to the manifest) does not exist")
    try:
        return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=stderr, cwd=cwd, env=env, start_new_session=True,
                                close_fds=True)
    except FileNotFoundError as exc:
        raise ToolError(f"MCP server {spec.name!r} cannot start: command not found: {argv[0]!r} "
                        f"(PATH={env['PATH']}, cwd={cwd}); use an absolute path, {{python}}, "
                        "or install it where the workers run") from exc
    except OSError as exc:
        raise ToolError(f"MCP server {spec.name!r} cannot start {argv[0]!r}: {exc}") from exc


def stop_process(proc: subprocess.Popen[bytes], grace: float = STOP_GRACE_S) -> None:
    """Close its stdin, give it `EXIT_GRACE_S` to exit, then SIGTERM and SIGKILL its group.

    The leader is reaped last (`WNOWAIT` until then), so the group id cannot be reused by an
    unrelated process while it is signalled."""
    with contextlib.suppress(OSError):
        if proc.stdin is not None:
            proc.stdin.close()
    if proc.returncode is None:
        if not _wait_leader(proc.pid, EXIT_GRACE_S):
            kill_group(proc.pid, signal.SIGTERM)
            _wait_leader(proc.pid, grace)
        if unreaped(proc.pid):  # else another waiter reaped it: its pid may be anyone's now
            kill_group(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=grace)


def _wait_leader(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


# ---------------------------------------------------------------- transports and sessions


@contextlib.asynccontextmanager
async def _pipes(proc: subprocess.Popen[bytes]) -> AsyncIterator[tuple[Any, Any]]:
    """The SDK's stream pair over a started process's stdout and stdin (newline-delimited
    JSON-RPC). The stream closes when the process's stdout does (it exited, mostly)."""
    assert proc.stdout is not None and proc.stdin is not None
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=MAX_MESSAGE_BYTES)
    read_transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), proc.stdout)
    write_transport, write_protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, proc.stdin)
    writer = asyncio.StreamWriter(write_transport, write_protocol, None, loop)
    to_session, from_server = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    to_server, from_session = anyio.create_memory_object_stream[SessionMessage](0)

    async def pump_out() -> None:
        async with to_session:
            while True:
                try:
                    line = await reader.readline()
                except (ValueError, OSError) as exc:  # a line over the limit, a broken pipe
                    log.warning("MCP server (pid %s): cannot read its output: %s", proc.pid, exc)
                    return
                if not line:
                    return
                if not line.strip():
                    continue
                try:
                    message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                except ValueError:
                    log.debug("MCP server (pid %s) wrote a line that is not JSON-RPC: %.200r",
                              proc.pid, line)
                    continue
                await to_session.send(SessionMessage(message))

    async def pump_in() -> None:
        async with from_session:
            async for item in from_session:
                text = item.message.model_dump_json(by_alias=True, exclude_unset=True)
                try:
                    writer.write(text.encode() + b"\n")
                    await writer.drain()
                except (OSError, RuntimeError):  # it closed its stdin: it is exiting
                    return

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(pump_out)
            group.start_soon(pump_in)
            try:
                yield from_server, to_server
            finally:
                group.cancel_scope.cancel()
    finally:
        read_transport.close()
        write_transport.close()


@contextlib.asynccontextmanager
async def connect(spec: MCPServerSpec, proc: subprocess.Popen[bytes] | None, timeout: float,
                  on_tools_changed: Callable[[], None] | None = None,
                  ) -> AsyncIterator[tuple[ClientSession, list[dict[str, Any]]]]:
    """An initialized session with the server and its tools (`tools/list`, every page): over
    the started process `proc` (stdio) or `spec.url` (streamable HTTP). TimeoutError when
    initializing and listing take longer than `timeout`. `on_tools_changed` is called (in a
    thread) when the server sends `notifications/tools/list_changed`."""

    async def notified(message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification) and on_tools_changed:
            await anyio.to_thread.run_sync(on_tools_changed)

    async with contextlib.AsyncExitStack() as stack:
        if proc is not None:
            read, write = await stack.enter_async_context(_pipes(proc))
        else:
            assert spec.url is not None
            http = await stack.enter_async_context(
                create_mcp_http_client(headers=server_headers(spec) or None))
            read, write = await stack.enter_async_context(
                streamable_http_client(spec.url, http_client=http))
        session = await stack.enter_async_context(
            ClientSession(read, write, client_info=CLIENT_INFO, message_handler=notified))
        with anyio.fail_after(timeout):
            await session.initialize()
            tools = await _list_all(session)
        yield session, tools


async def _list_all(session: ClientSession) -> list[dict[str, Any]]:
    tools: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:
        params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
        result = await session.list_tools(params=params)
        tools += [tool.model_dump(by_alias=True, mode="json", exclude_none=True)
                  for tool in result.tools]
        cursor = result.next_cursor
        if not cursor:
            return tools


def _leaf(exc: BaseException) -> BaseException:
    """The first exception inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def describe(exc: BaseException) -> str:
    """One line for an exception, task groups unwrapped."""
    exc = _leaf(exc)
    if isinstance(exc, MCPError):
        return f"{exc.message} (MCP error {exc.code})"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class Connection:
    """One initialized session with a server, held open by a task of the MCP event loop."""

    def __init__(self, spec: MCPServerSpec, proc: subprocess.Popen[bytes] | None,
                 on_tools_changed: Callable[[], None] | None = None) -> None:
        self.spec = spec
        self.proc = proc
        self.on_tools_changed = on_tools_changed
        """Called (in a thread) when the server says its tools changed."""
        self.session: ClientSession | None = None
        self.tools: list[dict[str, Any]] = []
        self.broken: str | None = None
        """Why it can no longer be used (None while it can)."""
        self._closing = asyncio.Event()
        self._held: concurrent.futures.Future[None] | None = None

    def open(self, timeout: float) -> None:
        """Connect, initialize and list the tools; ToolError (or ToolTimeout) if that fails."""
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._held = asyncio.run_coroutine_threadsafe(self._hold(ready, timeout), event_loop())
        try:
            try:
                ready.result(timeout + CALL_GRACE_S)
            except BaseExceptionGroup as group:  # from the connecting task's task groups
                raise _leaf(group) from None
        except (TimeoutError, concurrent.futures.TimeoutError) as exc:
            self.close()
            raise ToolTimeout(f"MCP server {self.spec.name!r} did not answer initialize and "
                              f"tools/list within {timeout:g}s (startup_timeout_s)") from exc
        except (KeyboardInterrupt, SystemExit):
            self.close()
            raise
        except BaseException as exc:  # what the connecting task raised, cancellation included
            self.close()
            raise ToolError(f"MCP server {self.spec.name!r} cannot be connected to: "
                            f"{describe(exc)}") from exc

    async def _hold(self, ready: concurrent.futures.Future[None], timeout: float) -> None:
        try:
            async with connect(self.spec, self.proc, timeout,
                               self.on_tools_changed) as (session, tools):
                self.session, self.tools = session, tools
                ready.set_result(None)
                await self._closing.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            elif self.broken is None:
                self.broken = describe(exc)
        finally:
            self.session = None
            self.broken = self.broken or "closed"

    def call(self, tool: str, arguments: Mapping[str, Any], timeout: float,
             cancelled: Cancelled | None = None) -> types.CallToolResult:
        """`tools/call`; ToolTimeout after `timeout`, ToolError when `cancelled` says so (both
        send `notifications/cancelled`), ConnectionLost, or ToolError for a protocol error."""
        session = self.session
        if session is None:
            raise ConnectionLost(self.broken or "not connected")
        name = f"{self.spec.name}.{tool}"
        future = asyncio.run_coroutine_threadsafe(
            session.call_tool(tool, dict(arguments), read_timeout_seconds=timeout,
                              meta=attempt_meta()), event_loop())
        limit = time.monotonic() + timeout + CALL_GRACE_S
        while True:
            try:
                result = future.result(timeout=CANCEL_POLL_S)
                break
            except (TimeoutError, concurrent.futures.TimeoutError):
                pass
            except MCPError as exc:
                if exc.code == types.REQUEST_TIMEOUT:
                    raise ToolTimeout(f"MCP tool {name} did not answer within {timeout:.3g}s; "
                                      "the server was sent notifications/cancelled") from None
                if exc.code == types.CONNECTION_CLOSED:
                    self.broken = self.broken or "connection closed"
                    raise ConnectionLost(f"the connection closed during tools/call {tool!r}") \
                        from None
                raise ToolError(f"MCP tool {name}: {describe(exc)}") from None
            except Exception as exc:  # a result that does not match its schema, mostly
                raise ToolError(f"MCP tool {name}: {describe(exc)}") from exc
            why = cancelled() if cancelled is not None else None
            if why:
                future.cancel()  # the SDK sends notifications/cancelled
                raise ToolError(f"MCP tool {name}: {why}; the server was sent "
                                "notifications/cancelled")
            if time.monotonic() > limit:
                future.cancel()
                raise ToolTimeout(f"MCP tool {name} did not answer within {timeout:.3g}s; the "
                                  "server was sent notifications/cancelled")
        return result

    def ping(self, timeout: float) -> str | None:
        """None if the server answers `ping` within `timeout`, else what went wrong."""
        session = self.session
        if session is None:
            return self.broken or "not connected"
        future = asyncio.run_coroutine_threadsafe(session.send_ping(), event_loop())
        try:
            future.result(timeout)
        except (TimeoutError, concurrent.futures.TimeoutError):
            future.cancel()
            return f"no answer to ping within {timeout:g}s"
        except Exception as exc:
            return f"ping failed: {describe(exc)}"
        return None

    def close(self, timeout: float = STOP_GRACE_S) -> None:
        """End the session (and, for stdio, close the server's stdin and stdout)."""
        held = self._held
        self.broken = self.broken or "closed"
        if held is None or held.done():
            return
        event_loop().call_soon_threadsafe(self._closing.set)
        try:
            held.result(timeout)
        except (TimeoutError, concurrent.futures.TimeoutError):
            held.cancel()
        except BaseException:  # its end was logged as `broken`
            pass


# ---------------------------------------------------------------- results


def result_value(result: types.CallToolResult) -> Any:
    """A tool's value: its `structuredContent` if it has one; else its text (one text block
    holding a JSON object or array is parsed); else its content blocks as they are."""
    if result.structured_content is not None:
        return result.structured_content
    blocks = [block.model_dump(by_alias=True, mode="json", exclude_none=True)
              for block in result.content]
    if not blocks:
        return None
    texts = [block["text"] for block in blocks if block.get("type") == "text"]
    if len(texts) != len(blocks):
        return blocks
    if len(texts) == 1 and texts[0].lstrip()[:1] in ("{", "["):
        with contextlib.suppress(ValueError):
            return json.loads(texts[0])
    return "\n".join(texts)


def error_text(result: types.CallToolResult) -> str:
    """What an `isError` result says."""
    texts = [getattr(block, "text", "") for block in result.content]
    text = "\n".join(t for t in texts if t).strip()
    return text or "the tool reported an error without a message"


# ---------------------------------------------------------------- listing at load time

_listed: dict[str, list[dict[str, Any]]] = {}
_listed_lock = threading.Lock()


def list_tools(servers: Sequence[MCPServerSpec]) -> dict[str, list[dict[str, Any]] | Exception]:
    """Each server's tools (`tools/list`), or the exception saying why they cannot be listed.

    Servers are asked concurrently, each within its `startup_timeout_s`; a stdio server is
    started for this and stopped. Answers are kept for the life of the process."""
    results: dict[str, list[dict[str, Any]] | Exception] = {}
    todo = []
    with _listed_lock:
        for spec in servers:
            if config_key(spec) in _listed:
                results[spec.name] = _listed[config_key(spec)]
            else:
                todo.append(spec)
    if not todo:
        return results

    async def all_of() -> list[list[dict[str, Any]] | BaseException]:
        return await asyncio.gather(*(_list_once(spec) for spec in todo), return_exceptions=True)

    answers: list[list[dict[str, Any]] | BaseException] = []
    failure: list[BaseException] = []

    def run() -> None:  # a thread of its own: the caller may be inside an event loop
        try:
            answers.extend(asyncio.run(all_of()))
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name="mcp-list-tools", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    for spec, answer in zip(todo, answers, strict=True):
        if isinstance(answer, BaseException):
            results[spec.name] = answer if isinstance(answer, Exception) else \
                RuntimeError(describe(answer))
        else:
            results[spec.name] = answer
            with _listed_lock:
                _listed[config_key(spec)] = answer
    return results


async def _list_once(spec: MCPServerSpec) -> list[dict[str, Any]]:
    timeout = spec.startup_timeout_s
    if spec.command is None:
        try:
            async with connect(spec, None, timeout) as (_, tools):
                return tools
        except BaseException as exc:
            raise ToolError(_why_not_listed(spec, exc)) from None
    home = Path(tempfile.mkdtemp(prefix=f"cortex-mcp-{spec.name}-"))
    with tempfile.TemporaryFile() as errors:
        proc = launch(spec, home, errors)
        try:
            async with connect(spec, proc, timeout) as (_, tools):
                return tools
        except BaseException as exc:
            code = await anyio.to_thread.run_sync(exit_code, proc.pid, 0.3)
            errors.seek(max(0, errors.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            tail = errors.read().decode(errors="replace").strip()
            why = f"it exited with code {code}" if code is not None else _why_not_listed(spec, exc)
            raise ToolError(f"{why}" + (f"; its output ends with:\n{tail}" if tail else "")) \
                from None
        finally:
            await anyio.to_thread.run_sync(stop_process, proc)
            shutil.rmtree(home, ignore_errors=True)


def _why_not_listed(spec: MCPServerSpec, exc: BaseException) -> str:
    exc = _leaf(exc)
    if isinstance(exc, TimeoutError):
        return (f"it did not answer initialize and tools/list within "
                f"{spec.startup_timeout_s:g}s (startup_timeout_s)")
    if isinstance(exc, ToolError):
        return str(exc)
    return describe(exc)


def exit_code(pid: int, wait: float) -> int | None:
    """The exit status of a child that exited (-N: killed by signal N), waiting up to `wait`
    seconds; None if it still runs. It is not reaped (`WNOWAIT`)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return None
        if info is not None:
            return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)
