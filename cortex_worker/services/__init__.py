"""Long-lived processes: relics (`kind: Relic`) and MCP servers (`kind: MCPServer`), both kept
by one generic pool per worker process (`pool`)."""
