"""An MCP server (the SDK's MCPServer) whose one tool, `change`, sends
`notifications/tools/list_changed` before it answers (tests/process/test_mcp.py: the shared
listing is dropped).

    python changing.py               # stdio
"""

from __future__ import annotations

from mcp.server.mcpserver import Context, MCPServer

server = MCPServer("changing")


@server.tool()
async def change(ctx: Context) -> str:
    """Say that this server's tools changed."""
    await ctx.request_context.session.send_tool_list_changed()
    return "changed"


if __name__ == "__main__":
    server.run()
