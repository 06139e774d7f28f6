"""Run an MCP tool (`runtime: mcp`, on the relic pool): its server's session, one `tools/call`.

`tools.runtime.run_tool` has validated the parameters and capped the timeout; this finds the
server, watches the action's status while the call waits (a cancelled job sends the server
`notifications/cancelled`) and maps the answer (see `mcp.manager.MCPManager.call_tool`).
"""

from __future__ import annotations

from typing import Any

from cortex_worker.handles import get_registry, get_store
from cortex_worker.services.mcp.client import Cancelled
from cortex_worker.services.mcp.listing import shared_listing
from cortex_worker.services.mcp.manager import MCPManager
from cortex_worker.services.mcp.spec import MCPServerSpec, tool_name
from cortex_worker.services.pool import service_pools
from cortex_worker.tools.context import ToolContext
from cortex_worker.tools.errors import ToolError
from cortex_worker.tools.spec import ToolSpec

ENDED = frozenset({"cancelled", "skipped"})
"""Statuses that mean the action was ended by someone else while its call runs."""


def run_mcp_tool(spec: ToolSpec, params: dict[str, Any], ctx: ToolContext) -> Any:
    """The tool's value; ToolError / ToolTimeout as `MCPManager.call_tool` raises them."""
    server = spec.mcp_server
    if not isinstance(server, MCPServerSpec):
        server = get_registry().mcp_servers.get(spec.server or "")
    if server is None:
        raise ToolError(f"tool {spec.name!r}: no MCP server named {spec.server!r} is declared")
    manager = service_pools().get(MCPManager, ctx.settings.workspace_root / "mcp")
    if manager.listing is None and ctx.settings.mcp_listing_ttl_s > 0:
        manager.listing = shared_listing(ctx.settings.redis_url, ctx.settings.mcp_listing_ttl_s)
    return manager.call_tool(server, tool_name(spec), params, ctx.timeout,
                             cancelled=action_ended(ctx))


def action_ended(ctx: ToolContext) -> Cancelled:
    """Asks Redis whether the action was cancelled (its job cancelled or ended) meanwhile."""

    def ended() -> str | None:
        try:
            status = get_store().action_status(ctx.job_id, ctx.action_id)
        except Exception:  # Redis away for a moment: keep waiting, the timeout still holds
            return None
        return f"the action was {status} (its job ended)" if status in ENDED else None

    return ended
