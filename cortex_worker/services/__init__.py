"""Long-lived processes: relics (`kind: Relic`) and MCP servers (`kind: MCPServer`)."""
