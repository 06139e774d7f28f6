"""MCP servers as tool sources (`kind: MCPServer`): their tools are tools named `<server>.<tool>`.

- `spec`: the manifest model and the `ToolSpec`s of a server's tools (no MCP SDK import: the
  API lists and validates MCP tools from it);
- `client`: the MCP SDK's client from threads: start a stdio server, connect (stdio or
  streamable HTTP), list tools (also at manifest load), call one, map its result;
- `manager`: MCP servers as a service pool (`services.pool`) on the relic pool (first use,
  ping, reuse, restart, idle stop);
- `tool_call`: `run_mcp_tool`, called by `tools.runtime.run_tool` for `runtime: mcp`.

Importing this package has no side effects.
"""
