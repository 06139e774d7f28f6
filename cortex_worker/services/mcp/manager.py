"""MCP servers on the relic pool: the relic lifecycle (`relics.manager.RelicManager`) with an
MCP session instead of an HTTP port.

`MCPManager` keeps at most one connection to each server per worker process, and for a stdio
server one process, exactly as relics are kept:

- **started on first use**: `client.launch` (own process group, minimal environment, in the
  manifest's directory, stderr to `<root>/logs/<name>.log`), then `initialize` and
  `tools/list` within `startup_timeout_s`; an HTTP server is connected to;
- **health-checked before use** with an MCP `ping` when the last good one is older than
  `health.interval_s`;
- **reused** across calls and jobs: concurrent calls share the session (MCP multiplexes them);
- **restarted** (reconnected) when its process has exited, its connection closed or a ping
  fails; a call the crash interrupted fails (it may have had effects), the next one restarts it;
- **stopped when idle** for `idle_timeout_s` by the reaper thread, never during a call: its
  stdin is closed, then SIGTERM and SIGKILL go to its group; **all stopped** at worker
  shutdown. Pid records under `<root>/pids` let the next manager kill what a worker killed by
  SIGKILL left running.

What it adds: `call_tool`. A call's timeout (the action's, capped by the server's or the
tool's `timeout`) and a cancelled action reach the server as `notifications/cancelled`; an
`isError` result or a protocol error fails the action with the server's message.
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cortex_worker.services.mcp.client import (
    EXIT_GRACE_S,
    Cancelled,
    Connection,
    ConnectionLost,
    error_text,
    exit_code,
    launch,
    result_value,
)
from cortex_worker.services.mcp.spec import MCPServerSpec
from cortex_worker.services.relics.manager import Instance, RelicManager
from cortex_worker.tools.errors import ToolError, ToolTimeout

log = logging.getLogger(__name__)


class _Remote:
    """The `proc` of an HTTP server's instance: no process runs here."""

    pid = 0
    returncode = None

    def poll(self) -> int | None:
        return None


@dataclass
class MCPInstance(Instance):
    """A running server: its process (stdio) and its session."""

    connection: Connection | None = None

    @property
    def stdio(self) -> bool:
        return isinstance(self.proc, subprocess.Popen)


class MCPManager(RelicManager):
    """Connections to MCP servers, by name, with the relic lifecycle; thread-safe."""

    def call_tool(self, spec: MCPServerSpec, tool: str, arguments: Mapping[str, Any],
                  timeout: float, cancelled: Cancelled | None = None) -> Any:
        """Run one tool of the server (starting it if needed): its value (`result_value`).

        ToolTimeout after `timeout` seconds (starting included); ToolError for an `isError`
        result, a protocol error, a server that cannot start or that exits during the call."""
        deadline = time.monotonic() + timeout
        inst = self.acquire(spec)  # type: ignore[arg-type]
        assert isinstance(inst, MCPInstance) and inst.connection is not None
        try:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ToolTimeout(f"MCP server {spec.name!r}: no time left for tool {tool!r} "
                                  "after starting it")
            try:
                result = inst.connection.call(tool, arguments, remaining, cancelled)
            except ConnectionLost as exc:
                raise ToolError(self._lost(inst, tool, exc)) from None
        finally:
            self.release(inst)
        if result.is_error:
            raise ToolError(f"MCP tool {spec.name}.{tool} failed: {error_text(result)}")
        return result_value(result)

    def tools(self, spec: MCPServerSpec) -> list[dict[str, Any]]:
        """What the running server answered to `tools/list` (starting it if needed)."""
        inst = self.acquire(spec)  # type: ignore[arg-type]
        try:
            assert isinstance(inst, MCPInstance) and inst.connection is not None
            return list(inst.connection.tools)
        finally:
            self.release(inst)

    # ------------------------------------------------------------ the lifecycle's steps

    def _start(self, spec: MCPServerSpec) -> MCPInstance:  # type: ignore[override]
        """Start (stdio) or reach (HTTP) the server and open its session (caller holds the
        server's lock)."""
        home = self.root / "home" / spec.name
        logs = self.root / "logs"
        for directory in (home, logs, self.root / "pids"):
            directory.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{spec.name}.log"
        with open(log_path, "ab") as out:
            where = spec.url or spec.command
            out.write(f"--- cortex: starting MCP server {spec.name}: {where}\n".encode())
            out.flush()
            offset = out.tell()
            proc: Any = launch(spec, home, out) if spec.command is not None else _Remote()
        pid_file = self.root / "pids" / f"{spec.name}.{os.getpid()}.json"
        inst = MCPInstance(spec, proc, 0, log_path, offset, pid_file)  # type: ignore[arg-type]
        if inst.stdio:
            self._record(inst)
        connection = Connection(spec, proc if inst.stdio else None)
        try:
            connection.open(spec.startup_timeout_s)
        except ToolError as exc:
            code = exit_code(inst.pid, 0.3) if inst.stdio else None
            self._stop(inst, "failed to start")
            if code is not None:
                raise ToolError(f"MCP server {spec.name!r} exited with code {code} while "
                                f"starting (command {spec.command}){self._tail(inst)}") from None
            raise type(exc)(f"{exc}{self._tail(inst) if inst.stdio else ''}") from None
        inst.connection = connection
        inst.last_healthy = inst.last_used = time.monotonic()
        with self._lock:
            self._instances[spec.name] = inst
        log.info("MCP server %s started (%s, %d tools)", spec.name,
                 f"pid {inst.pid}" if inst.stdio else spec.url, len(connection.tools))
        self._ensure_reaper()
        return inst

    def _unfit(self, inst: Instance) -> str | None:
        """Why the instance must be restarted before use: its process exited, its connection
        closed, or it does not answer a ping (every `health.interval_s`)."""
        assert isinstance(inst, MCPInstance)
        code = inst.exited()
        if code is not None:
            return f"exited with code {code}"
        broken = inst.connection.broken if inst.connection is not None else "not connected"
        if broken is not None:
            return f"lost its connection ({broken})"
        return super()._unfit(inst)

    def _health(self, inst: Instance) -> str | None:
        assert isinstance(inst, MCPInstance) and inst.connection is not None
        return inst.connection.ping(inst.spec.health.timeout_s)

    def _stop(self, inst: Instance, reason: str) -> None:
        """Close the session (a stdio server sees its stdin close), then stop the process as a
        relic's is stopped: SIGTERM to its group, SIGKILL after the grace period."""
        assert isinstance(inst, MCPInstance)
        if inst.connection is not None:
            inst.connection.close()
        if inst.stdio:
            if inst.proc.returncode is None:
                exit_code(inst.pid, EXIT_GRACE_S)  # let it exit on its own first
            super()._stop(inst, reason)
            return
        with self._lock:
            if self._instances.get(inst.spec.name) is inst:
                del self._instances[inst.spec.name]
        log.info("MCP server %s (%s) disconnected: %s", inst.spec.name, inst.spec.url, reason)

    def _lost(self, inst: MCPInstance, tool: str, exc: ToolError) -> str:
        name = inst.spec.name
        if inst.stdio:
            code = exit_code(inst.pid, 1.0)
            if code is not None:
                return (f"MCP server {name!r} exited with code {code} during tool {tool!r}; it "
                        f"is restarted on next use{self._tail(inst)}")
        return f"MCP server {name!r}: {exc}; it is restarted (reconnected) on next use"


# ---------------------------------------------------------------- the process's manager

_manager: MCPManager | None = None
_manager_lock = threading.Lock()


def get_mcp_manager(root: Path) -> MCPManager:
    """This process's manager (created on first use, with `root` for its files)."""
    global _manager
    with _manager_lock:
        if _manager is None:
            _manager = MCPManager(root)
            _install_shutdown_hooks()
        return _manager


def shutdown(**_: Any) -> None:
    """Stop every MCP server this process started (worker shutdown, interpreter exit)."""
    manager = _manager
    if manager is not None:
        manager.stop_all()


_hooks_installed = False


def _install_shutdown_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    from celery.signals import worker_process_shutdown, worker_shutdown

    atexit.register(shutdown)
    worker_shutdown.connect(shutdown, weak=False)
    worker_process_shutdown.connect(shutdown, weak=False)
    _hooks_installed = True
