"""The sandbox against hostile tool code, on real workers.

Each hostile action must end as a clean action failure (or, where it is harmless, a
completed action that shows it was contained), and afterwards the worker is still there and
the next action succeeds. Python and shell tools run in namespaces of their own
(cortex_worker/sandbox/isolation.py); the tests that rely on them skip, with the reason,
where the kernel refuses namespaces.

This module starts its own Redis, `agent` and `tool` workers and API: the workers carry a fake
secret in their environment (`CORTEX_TEST_SECRET`) that no tool may see.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cortex_worker.sandbox import isolation
from cortex_worker.settings import Settings
from cortex_worker.tools.attempt import ENV as ATTEMPT_ENV
from cortex_worker.tools.context import tool_user
from tests import harness
from tests.integration.test_documents import action, of, one, run

SECRET = f"cortex-test-secret-{uuid.uuid4().hex}"
isolated = pytest.mark.skipif(
    isolation.unavailable_reason() is not None,
    reason=f"namespaces unavailable here: {isolation.unavailable_reason()}")


class Stack:
    def __init__(self, api: harness.Process, workers: dict[str, harness.Process],
                 workspaces: Path) -> None:
        self.api, self.workers, self.workspaces = api, workers, workspaces
        self.url = api.url


@pytest.fixture(scope="module")
def stack(cortex_env: dict[str, str], harness_dir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir = harness_dir / "sandbox"
    server = harness.RedisServer(log_dir=log_dir, data_dir=log_dir / "redis")
    server.start()
    workspaces = tmp_path_factory.mktemp("sandbox-workspaces")
    env = {**cortex_env, "CORTEX_REDIS_URL": server.url, "CORTEX_TEST_SECRET": SECRET,
           "CORTEX_WORKSPACE_ROOT": str(workspaces)}
    procs: list[harness.Process] = []
    try:
        workers = harness.start_workers({"agent": 2, "tool": 2}, env, log_dir=log_dir,
                                        cwd=log_dir)
        procs += workers.values()
        api = harness.start_api(env, log_dir=log_dir, cwd=log_dir)
        procs.append(api)
        yield Stack(api, workers, workspaces)
    finally:
        harness.stop_all(processes=procs)
        server.close()


def python_action(ident: str, code: str, **extra: Any) -> str:
    return action(ident, "python", {"code": code}, **extra)


def survives(stack: Stack) -> None:
    """The workers are alive and a following job (a sandboxed snippet too) succeeds."""
    for proc in stack.workers.values():
        assert proc.alive, proc.describe()
    doc = action("after", "echo", {"message": "still here"}) + python_action("py", "6 * 7")
    _, events = run(stack, doc)
    assert events[-1]["type"] == "job_completed", events[-1]
    assert one(events, "action_completed", "py")["data"]["result"]["result"] == 42


def failed(events: list[dict[str, Any]], ident: str) -> dict[str, Any]:
    assert events[-1]["type"] == "job_failed", events[-1]
    return one(events, "action_failed", ident)["data"]


def processes_under(root: Path) -> list[int]:
    """Pids whose working directory is under `root` (the sandboxes run in job workspaces)."""
    found = []
    root = root.resolve()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = Path(os.readlink(entry / "cwd"))
        except OSError:
            continue
        if cwd.is_relative_to(root):
            found.append(int(entry.name))
    return found


# --------------------------------------------------------------------------- secrets


def test_worker_secrets_are_not_in_the_tool_environment(stack: Stack) -> None:
    code = ("import os, json\n"
            "print(json.dumps({'secret': os.environ.get('CORTEX_TEST_SECRET'),"
            " 'keys': sorted(os.environ)}))")
    _, events = run(stack, python_action("env", code))
    assert events[-1]["type"] == "job_completed", events[-1]
    seen = json.loads(one(events, "action_completed", "env")["data"]["result"]["stdout"])
    assert seen["secret"] is None
    # the call's own attempt (tools/attempt.py) is all a tool gets of Cortex's variables
    assert not [k for k in seen["keys"] if k.startswith(("CORTEX_", "CELERY_", "REDIS"))
                and k not in ATTEMPT_ENV]
    assert SECRET not in json.dumps(events)
    survives(stack)


@isolated
def test_worker_environment_is_out_of_reach_through_proc(stack: Stack) -> None:
    """A snippet looks for the secret in every /proc/<pid>/environ it can see, and in the
    tool workers' own pids: its PID namespace shows only the sandbox."""
    worker_pids = [p.pid for p in stack.workers.values()]
    code = ("import json, os\n"
            "seen, leaks, direct = [], 0, {}\n"
            "for p in [p for p in os.listdir('/proc') if p.isdigit()]:\n"
            "    seen.append(int(p))\n"
            "    try:\n"
            "        leaks += b'CORTEX_TEST_SECRET=' in open(f'/proc/{p}/environ', 'rb').read()\n"
            "    except OSError:\n"
            "        pass\n"
            f"for p in {worker_pids!r}:\n"
            "    try:\n"
            "        open(f'/proc/{p}/environ', 'rb').read()\n"
            "        direct[p] = 'read'\n"
            "    except OSError as exc:\n"
            "        direct[p] = exc.strerror\n"
            "print(json.dumps({'seen': sorted(seen), 'leaks': leaks, 'direct': direct}))\n")
    _, events = run(stack, python_action("proc", code))
    assert events[-1]["type"] == "job_completed", events[-1]
    outcome = json.loads(one(events, "action_completed", "proc")["data"]["result"]["stdout"])
    print(f"/proc from a python snippet: {outcome}")
    assert outcome["leaks"] == 0 and outcome["seen"] == [1, 2]
    assert "read" not in outcome["direct"].values()
    survives(stack)


# --------------------------------------------------------------------------- files


def test_write_file_refuses_paths_outside_the_workspace(stack: Stack) -> None:
    target = Path(f"/tmp/cortex-escape-{uuid.uuid4().hex}")
    doc = (action("abs", "write_file", {"path": str(target), "content": "x"})
           + action("dots", "write_file", {"path": f"../../../../..{target}", "content": "x"})
           + action("home", "write_file", {"path": "~/escape", "content": "x"}))
    _, events = run(stack, doc)
    for ident, why in (("abs", "absolute"), ("dots", "escapes the workspace"),
                       ("home", "absolute")):
        error = one(events, "action_failed", ident)["data"]["error"]
        assert why in error, (ident, error)
    assert events[-1]["type"] == "job_failed"
    assert not target.exists()
    survives(stack)


@isolated
def test_a_python_snippet_cannot_write_outside_its_workspace(stack: Stack) -> None:
    """Everything but the workspace is mounted read-only in the sandbox."""
    target = Path(f"/tmp/cortex-escape-{uuid.uuid4().hex}")
    code = f"open({str(target)!r}, 'w').write('escaped')\nprint('wrote')"
    _, events = run(stack, python_action("raw", code))
    error = failed(events, "raw")["error"]
    assert "Read-only file system" in error or "Permission denied" in error, error
    assert not target.exists()
    # RLIMIT_FSIZE bounds what it writes inside (64 MiB by default)
    code = "f = open('big.bin', 'wb')\nfor _ in range(80):\n    f.write(b'x' * 2**20)\n"
    job_id, events = run(stack, python_action("big", code))
    error = failed(events, "big")["error"]
    assert "file size limit" in error or "File too large" in error, error
    assert (stack.workspaces / job_id / "big.bin").stat().st_size <= 64 * 2**20
    survives(stack)


# --------------------------------------------------------------------------- processes


FORK_BOMB = """
import os, time
forked = 0
for _ in range(300):          # bounded: at most 300 children, none of which forks
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(120)
        os._exit(0)
    forked += 1
print('forked', forked, flush=True)
time.sleep(120)
"""


def test_fork_bomb_is_contained_by_timeout_and_group_kill(stack: Stack) -> None:
    before = len(processes_under(stack.workspaces))
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.2):
            peak[0] = max(peak[0], len(processes_under(stack.workspaces)))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        _, events = run(stack, python_action("bomb", FORK_BOMB, timeout=4))
    finally:
        stop.set()
        watcher.join()
    data = failed(events, "bomb")
    # its 4 s timeout ended it, not the two minutes its processes sleep
    assert data["status"] == "timeout", data
    assert data["error"].startswith("timed out after 4s"), data
    user = tool_user(Settings())
    print(f"fork bomb: peak {peak[0]} processes in job workspaces, tools run as uid "
          f"{user[0] if user else os.getuid()} (RLIMIT_NPROC binds for any uid but root)")
    # every forked child died with the group: nothing is left in a workspace
    harness.wait_until(lambda: len(processes_under(stack.workspaces)) <= before, timeout=10,
                       message=lambda: f"left behind: {processes_under(stack.workspaces)}")
    survives(stack)


def test_memory_past_the_limit_fails_cleanly(stack: Stack) -> None:
    code = "blocks = []\nwhile True:\n    blocks.append(bytearray(64 * 2**20))\n"
    _, events = run(stack, python_action("hog", code, timeout=30))
    error = failed(events, "hog")["error"]
    assert "MemoryError" in error, error
    survives(stack)


def test_infinite_loop_times_out(stack: Stack) -> None:
    _, events = run(stack, python_action("spin", "while True:\n    pass\n", timeout=2))
    data = failed(events, "spin")
    # the loop never ends by itself: its 2 s timeout ended it
    assert data["status"] == "timeout", data
    assert data["error"].startswith("timed out after 2s"), data
    harness.wait_until(lambda: not processes_under(stack.workspaces), timeout=10)
    survives(stack)


@isolated
def test_setsid_does_not_escape(stack: Stack) -> None:
    """A child that leaves the process group still dies with the sandbox's PID namespace."""
    marker = f"cortex-setsid-{uuid.uuid4().hex}"
    code = (f"import os, time\nif os.fork() == 0:\n    os.setsid()\n"
            f"    os.execvp('sh', ['sh', '-c', 'sleep 30 # {marker}'])\nprint('left it')\n")
    _, events = run(stack, python_action("escape", code))
    assert events[-1]["type"] == "job_completed", events[-1]
    time.sleep(0.5)
    escaped = [pid for pid in processes_under(stack.workspaces)
               if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()]
    print(f"processes that escaped the group with setsid(): {len(escaped)}")
    for pid in escaped:  # never leak out of the test, even when it fails
        os.kill(pid, 9)
    assert escaped == []
    survives(stack)


# --------------------------------------------------------------------------- network


@pytest.fixture
def listener() -> Iterator[tuple[int, list[bytes]]]:
    """A TCP server on 127.0.0.1 that records what connects to it."""
    received: list[bytes] = []
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(5)
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    received.append(conn.recv(100))
                except OSError:
                    received.append(b"")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], received
    finally:
        stop.set()
        thread.join()
        server.close()


def test_http_get_refuses_non_loopback_hosts_before_connecting(stack: Stack) -> None:
    urls = ["http://example.com/", "http://169.254.169.254/latest/meta-data/",
            "http://10.0.0.1/", "file:///etc/passwd", "http://[::ffff:8.8.8.8]/",
            "gopher://127.0.0.1/"]
    doc = "".join(action(f"u{i}", "http_get", {"url": url}) for i, url in enumerate(urls))
    _, events = run(stack, doc)
    for i, url in enumerate(urls):
        # refused up front, by the check before any connection: its error, not a connect
        # error or timeout
        data = one(events, "action_failed", f"u{i}")["data"]
        error = data["error"]
        assert data["status"] == "error", (url, data)
        assert (error.startswith("only http and https URLs are allowed")
                or re.match(r"host '[^']+' is not allowed: http_get reaches loopback hosts",
                            error)), (url, error)
    survives(stack)


def test_python_snippets_have_no_network(
        stack: Stack, listener: tuple[int, list[bytes]]) -> None:
    """Sandboxed processes run in a network namespace of their own (the worker is root here;
    elsewhere an unprivileged user namespace): no connection, not even to loopback."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces for the sandbox are only guaranteed for a root worker")
    port, received = listener
    code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=5)\n"
            "s.sendall(b'hello from the sandbox')\ns.close()\nprint('connected')")
    _, events = run(stack, python_action("net", code))
    error = failed(events, "net")["error"]
    assert "Network is unreachable" in error, error
    time.sleep(0.5)
    assert received == []  # nothing reached the listener
    survives(stack)


def test_many_hostile_actions_at_once_leave_the_worker_serving(stack: Stack) -> None:
    doc = (python_action("spin", "while True:\n    pass\n", timeout=3)
           + python_action("hog", "x = bytearray(4 * 2**30)")
           + python_action("exit", "import os\nos._exit(3)")
           + python_action("kill", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
           + python_action("flood", "import sys\nsys.stdout.write('y' * 50_000_000)"))
    _, events = run(stack, doc)
    assert events[-1]["type"] == "job_failed", [e["type"] for e in events]
    errors = {e["data"]["action_id"]: e["data"]["error"] for e in of(events, "action_failed")}
    assert {"spin", "hog", "exit", "kill"} <= set(errors), errors
    print("hostile actions at once:", {k: v[:80] for k, v in errors.items()})
    survives(stack)
