"""Who holds a lease, a turn or a container: this process as `host:pid`, and whether a holder
is known to be dead (a process of this host that no longer runs)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

HOST = socket.gethostname()
#: A lease held by a child job (an agent or workflow action) names it `child:<child id>`; it
#: is not a process, and is never dead: the child is recovered on its own.
CHILD_OWNER = "child:"


def owner() -> str:
    """This process as an owner: `host:pid`."""
    return f"{HOST}:{os.getpid()}"


def dead_here(holder: str) -> bool:
    """True if `holder` is a process of this host that no longer runs (gone, or a zombie
    nobody reaped). A holder on another host is never known to be dead."""
    host, _, pid = holder.rpartition(":")
    if host != HOST or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[:1] == ["Z"]
