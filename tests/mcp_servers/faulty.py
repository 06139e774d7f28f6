"""An MCP server (the SDK's MCPServer) that misbehaves on request, for the MCP tests.

- `pid`: its process id (restarts and reuse are visible in the results);
- `crash`: exits at once with `code`, in the middle of the call;
- `hang`: writes "started" to the file `marker`, then sleeps (until the file `release`
  exists, if named); when the client cancels the call (`notifications/cancelled`) it appends
  "cancelled" to `marker`;
- `fail`: answers an error result (`isError`) saying `message`.

    python faulty.py                 # stdio
    python faulty.py --http PORT     # streamable HTTP on 127.0.0.1:PORT, path /mcp
"""

from __future__ import annotations

import os
import sys

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("faulty")


@server.tool()
def pid() -> dict[str, int]:
    """This server's process id."""
    return {"pid": os.getpid()}


@server.tool()
def crash(code: int = 3) -> str:
    """Exit at once with `code`."""
    print("crashing on purpose", file=sys.stderr, flush=True)
    os._exit(code)


@server.tool()
async def hang(marker: str, seconds: float = 3600, release: str = "") -> dict[str, float]:
    """Sleep `seconds`; mark the file `marker` when it starts and when it is cancelled. With
    `release`, answer `released` as soon as that file exists."""
    with open(marker, "a") as f:
        f.write("started\n")
    try:
        with anyio.move_on_after(seconds):
            while not (release and os.path.exists(release)):
                await anyio.sleep(0.01)
            return {"released": 1.0}
    except anyio.get_cancelled_exc_class():
        with open(marker, "a") as f:
            f.write("cancelled\n")
        raise
    return {"slept": seconds}


@server.tool()
def fail(message: str) -> str:
    """Answer an error result saying `message`."""
    raise ToolError(message)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
