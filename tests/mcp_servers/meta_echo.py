"""An MCP server (the SDK's MCPServer) whose one tool, `meta`, answers the `_meta` of its
request: what a server sees of the caller's attempt (tests/process/test_idempotency.py).

    python meta_echo.py              # stdio
"""

from __future__ import annotations

from typing import Any

from mcp.server.mcpserver import Context, MCPServer

server = MCPServer("meta_echo")


@server.tool()
def meta(ctx: Context) -> dict[str, Any]:
    """The `_meta` object of this tools/call request ({} if none)."""
    return dict(ctx.request_context.meta or {})


if __name__ == "__main__":
    server.run()
