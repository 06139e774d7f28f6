"""Functions run by the warm runner in tests/process/test_warm.py (a python tool module).

`IMPORTED_IN` is the process that imported the module: the zygote when the call is warm, the
call's own process when it is cold. With WARM_TOOLS_THREAD set, importing it starts a thread.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
import time
from typing import Any

IMPORTED_IN = os.getpid()
CALLS: list[Any] = []
NAMESPACES = ("pid", "mnt", "ipc", "uts", "net")

if os.environ.get("WARM_TOOLS_THREAD"):
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()


def whoami() -> dict[str, Any]:
    """Who and where the call runs."""
    return {"imported_in": IMPORTED_IN, "pid": os.getpid(), "ppid": os.getppid(),
            "uid": os.getuid(), "cwd": os.getcwd(), "env": dict(os.environ),
            "pids": sorted(p for p in os.listdir("/proc") if p.isdigit()),
            "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
            "namespaces": {ns: os.readlink(f"/proc/self/ns/{ns}") for ns in NAMESPACES}}


def whoami_held(marker: str, release: str) -> dict[str, Any]:
    """`whoami`, then `marker` written, then alive (its namespaces with it) until `release`
    exists: two such calls are seen side by side, so their namespaces cannot be one recycled
    inode number."""
    me = whoami()
    with open(marker, "w") as f:
        f.write("here")
    deadline = time.monotonic() + 60
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.01)
    return me


def remember(value: Any) -> int:
    """Mutates the module's globals: how many values this process has seen."""
    CALLS.append(value)
    return len(CALLS)


def write(paths: list[str]) -> dict[str, str]:
    """Try to write each path: 'wrote' or the error."""
    out = {}
    for path in paths:
        try:
            with open(path, "w") as f:
                f.write("x")
            out[path] = "wrote"
        except OSError as exc:
            out[path] = exc.strerror or str(exc)
    return out


def listdir(path: str) -> list[str]:
    return sorted(os.listdir(path))


def limits() -> str:
    with open("/proc/self/limits") as f:
        return f.read()


def spin() -> None:
    while True:
        pass


def linger(marker: str, setsid: bool = False) -> None:
    """Start a child that outlives this function (unless the sandbox kills it), then sleep."""
    child = subprocess.Popen(["sh", "-c", f"sleep 60 # {marker}"], start_new_session=setsid)
    with open("pids", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(60)


def detach(marker: str) -> str:
    """Leave a child in a session of its own, without this call's output, and return."""
    subprocess.Popen(["sh", "-c", f"sleep 60 # {marker}"], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    return "done"


def slow_exit(seconds: float) -> str:
    """Answer, then take `seconds` to exit, writing to stdout and stderr on the way out."""
    def late() -> None:
        time.sleep(seconds)
        print("written after the answer", flush=True)
        sys.stderr.write("also written after the answer\n")

    atexit.register(late)
    return "answered"
