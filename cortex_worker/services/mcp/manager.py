"""MCP servers on the relic pool: a service pool (`cortex_worker.services.pool`) whose instances
hold an MCP session instead of an HTTP port.

`MCPManager` keeps at most one connection to each server per worker process, and for a stdio
server one process, with the pool's lifecycle:

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

A server's `tools/list` answer, on each connection, refreshes the listing shared through Redis
(`listing.SharedListing.publish`), and `notifications/tools/list_changed` drops it.

What it adds: `call_tool`. A call's timeout (the action's, capped by the server's or the
tool's `timeout`) and a cancelled action reach the server as `notifications/cancelled`; an
`isError` result or a protocol error fails the action with the server's message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
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
from cortex_worker.services.mcp.listing import SharedListing
from cortex_worker.services.mcp.spec import MCPServerSpec
from cortex_worker.services.pool import Instance, ServicePool
from cortex_worker.tools.errors import ToolError, ToolTimeout

log = logging.getLogger(__name__)


@dataclass
class MCPInstance(Instance[MCPServerSpec]):
    """A server: its process (stdio; None for an HTTP server) and its session."""

    connection: Connection | None = None

    @property
    def stdio(self) -> bool:
        return self.proc is not None


class MCPManager(ServicePool[MCPServerSpec, MCPInstance]):
    """Connections to MCP servers, by name, with the pool's lifecycle; thread-safe."""

    kind = "MCP server"
    listing: SharedListing | None = None
    """Where the cluster's tool listings are shared (`run_mcp_tool` sets it): refreshed when a
    server is connected to, dropped when it says its tools changed."""

    def _tools_changed(self, spec: MCPServerSpec) -> None:
        log.info("MCP server %s: its tools changed (notifications/tools/list_changed); they "
                 "are listed again when the manifests next load", spec.name)
        if self.listing is not None:
            try:
                self.listing.forget(spec)
            except Exception as exc:
                log.warning("MCP server %s: its shared listing cannot be dropped: %s",
                            spec.name, exc)

    def call_tool(self, spec: MCPServerSpec, tool: str, arguments: Mapping[str, Any],
                  timeout: float, cancelled: Cancelled | None = None) -> Any:
        """Run one tool of the server (starting it if needed): its value (`result_value`).

        ToolTimeout after `timeout` seconds (starting included); ToolError for an `isError`
        result, a protocol error, a server that cannot start or that exits during the call."""
        deadline = time.monotonic() + timeout
        inst = self.acquire(spec)
        try:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ToolTimeout(f"MCP server {spec.name!r}: no time left for tool {tool!r} "
                                  "after starting it")
            try:
                result = _session(inst).call(tool, arguments, remaining, cancelled)
            except ConnectionLost as exc:
                raise ToolError(self._lost(inst, tool, exc)) from None
        finally:
            self.release(inst)
        if result.is_error:
            raise ToolError(f"MCP tool {spec.name}.{tool} failed: {error_text(result)}")
        return result_value(result)

    def tools(self, spec: MCPServerSpec) -> list[dict[str, Any]]:
        """What the running server answered to `tools/list` (starting it if needed)."""
        inst = self.acquire(spec)
        try:
            return list(_session(inst).tools)
        finally:
            self.release(inst)

    # ------------------------------------------------------------ the pool's steps

    def _start(self, spec: MCPServerSpec) -> MCPInstance:
        """Start (stdio) or reach (HTTP) the server and open its session (caller holds the
        server's lock)."""
        home, log_path = self._directories(spec.name)
        with open(log_path, "ab") as out:
            where = spec.url or spec.command
            out.write(f"--- cortex: starting MCP server {spec.name}: {where}\n".encode())
            out.flush()
            offset = out.tell()
            proc = launch(spec, home, out) if spec.command is not None else None
        inst = MCPInstance(spec, proc, log_path, offset, self._pid_file(spec.name))
        if inst.stdio:
            self._record(inst)
        connection = Connection(spec, proc, on_tools_changed=lambda: self._tools_changed(spec))
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
        if self.listing is not None:  # the cluster's listing, fresh from this session
            try:
                self.listing.publish(spec, connection.tools)
            except Exception as exc:  # only a cache: the call goes on
                log.debug("MCP server %s: listing not shared: %s", spec.name, exc)
        log.info("MCP server %s started (%s, %d tools)", spec.name,
                 f"pid {inst.pid}" if inst.stdio else spec.url, len(connection.tools))
        return inst

    def _unfit(self, inst: MCPInstance) -> str | None:
        """Why the instance must be restarted before use: its process exited, its connection
        closed, or it does not answer a ping (every `health.interval_s`)."""
        code = inst.exited()
        if code is not None:
            return f"exited with code {code}"
        broken = inst.connection.broken if inst.connection is not None else "not connected"
        if broken is not None:
            return f"lost its connection ({broken})"
        return super()._unfit(inst)

    def _health(self, inst: MCPInstance) -> str | None:
        return _session(inst).ping(inst.spec.health.timeout_s)

    def _close(self, inst: MCPInstance) -> None:
        """Close the session (a stdio server sees its stdin close) and give a stdio server
        `EXIT_GRACE_S` to exit on its own before its group is signalled."""
        if inst.connection is not None:
            inst.connection.close()
        if inst.proc is not None and inst.proc.returncode is None:
            exit_code(inst.pid, EXIT_GRACE_S)

    def _lost(self, inst: MCPInstance, tool: str, exc: ToolError) -> str:
        name = inst.spec.name
        if inst.stdio:
            code = exit_code(inst.pid, 1.0)
            if code is not None:
                return (f"MCP server {name!r} exited with code {code} during tool {tool!r}; it "
                        f"is restarted on next use{self._tail(inst)}")
        return f"MCP server {name!r}: {exc}; it is restarted (reconnected) on next use"


def _session(inst: MCPInstance) -> Connection:
    """The session of a started instance (`_start` sets it before the pool hands it out)."""
    if inst.connection is None:
        raise ToolError(f"MCP server {inst.spec.name!r} has no session")
    return inst.connection
