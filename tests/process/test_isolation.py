"""Namespaces around the sandbox (cortex_worker.sandbox.isolation), on real processes.

Skipped as a whole where the kernel refuses namespaces (the reason is printed); CI machines
run as root, where they always work.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cortex_worker.sandbox import isolation
from cortex_worker.sandbox.isolation import Isolation, interpreter_paths, mount_points, veils
from cortex_worker.sandbox.process import SandboxError, SandboxResult, run_sandboxed
from cortex_worker.tools.spec import Limits

pytestmark = pytest.mark.process

PY = sys.executable
NOBODY = isolation.sandbox_user("nobody")
needs_namespaces = pytest.mark.skipif(
    isolation.unavailable_reason() is not None,
    reason=f"namespaces unavailable here: {isolation.unavailable_reason()}")
needs_root = pytest.mark.skipif(NOBODY is None, reason="switching users needs a root worker")


@pytest.fixture
def workspaces(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "workspaces"
    (root / "mine").mkdir(parents=True)
    (root / "theirs").mkdir()
    (root / "theirs" / "secret.txt").write_text("another job's file")
    yield root


def run_py(code: str, workspace: Path, *, timeout: float = 20, **iso: object) -> SandboxResult:
    options = {"readable": interpreter_paths(), **iso}
    return run_sandboxed([PY, "-c", code], cwd=workspace, timeout=timeout,
                         isolation=Isolation(writable=workspace, **options))  # type: ignore[arg-type]


def lines(result: SandboxResult) -> list[str]:
    assert result.returncode == 0, (result.returncode, result.stderr.decode())
    return result.stdout.decode().split()


# ---------------------------------------------------------------- pure helpers


def test_mount_points_unescape_and_keep_flags(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
        "30 22 0:5 / /my\\040dir rw,nosuid,nodev,noexec - tmpfs tmpfs rw\n")
    assert mount_points(str(info)) == [
        ("/", isolation.MS_RELATIME),
        ("/my dir", isolation.MS_NOSUID | isolation.MS_NODEV | isolation.MS_NOEXEC)]


def test_veils_hide_the_workspace_root_and_closed_directories(tmp_path: Path) -> None:
    tmp_path = Path(tempfile.mkdtemp(prefix="cortex-veils-"))  # pytest's own is closed (0700)
    tmp_path.chmod(0o755)
    closed = tmp_path / "closed"
    (closed / "venv" / "lib").mkdir(parents=True)
    closed.chmod(0o700)
    root = tmp_path / "ws"
    (root / "job").mkdir(parents=True)
    iso = Isolation(writable=root / "job", hide=root,
                    readable=(closed / "venv", closed / "venv" / "lib"))
    assert veils(iso, None) == [(str(root), [str(root / "job")])]
    try:
        assert veils(iso, (65534, 65534)) == [(str(closed), [str(closed / "venv")]),
                                               (str(root), [str(root / "job")])]
    finally:
        shutil.rmtree(tmp_path)


# ---------------------------------------------------------------- what the tool sees


@needs_namespaces
def test_only_its_own_processes_are_visible(workspaces: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORTEX_ISOLATION_SECRET", "hunter2")
    code = ("import os\n"
            "found = [p for p in os.listdir('/proc') if p.isdigit()]\n"
            "leaks = 0\n"
            "for p in found:\n"
            "    try:\n"
            "        leaks += b'hunter2' in open(f'/proc/{p}/environ', 'rb').read()\n"
            "    except OSError:\n"
            "        pass\n"
            "print(os.getpid(), os.getppid(), len(found), leaks)\n")
    pid, ppid, count, leaks = lines(run_py(code, workspaces / "mine"))
    assert (pid, ppid, count, leaks) == ("2", "1", "2", "0")  # the sandbox init and itself


@needs_namespaces
def test_everything_but_the_workspace_is_read_only(workspaces: Path, tmp_path: Path) -> None:
    outside = tmp_path / f"escape-{os.getpid()}"
    code = ("import json, os\n"
            "out = {}\n"
            f"for path in ({str(outside)!r}, '/etc/cortex-x', '/dev/shm/cortex-x', "
            "'/tmp/cortex-x'):\n"
            "    try:\n"
            "        open(path, 'w').write('x')\n"
            "        out[path] = 'wrote'\n"
            "    except OSError as exc:\n"
            "        out[path] = exc.strerror\n"
            "open('mine.txt', 'w').write('mine')\n"
            "print(json.dumps(out))\n")
    result = run_py(code, workspaces / "mine")
    assert result.returncode == 0, result.stderr.decode()
    denied = json.loads(result.stdout)
    assert set(denied.values()) <= {"Read-only file system", "Permission denied"}, denied
    assert not outside.exists()
    assert (workspaces / "mine" / "mine.txt").read_text() == "mine"


@needs_namespaces
def test_other_workspaces_are_hidden(workspaces: Path) -> None:
    code = f"import os; print(*sorted(os.listdir({str(workspaces)!r})))"
    assert lines(run_py(code, workspaces / "mine", hide=workspaces)) == ["mine"]
    assert sorted(lines(run_py(code, workspaces / "mine"))) == ["mine", "theirs"]


@needs_namespaces
def test_no_network_unless_asked(workspaces: Path) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    code = ("import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')\n"
            "except OSError as exc:\n"
            "    print('refused', exc.errno)\n")
    try:
        assert lines(run_py(code, workspaces / "mine"))[0] == "refused"
        assert lines(run_py(code, workspaces / "mine", network=False)) == ["connected"]
    finally:
        server.close()


# ---------------------------------------------------------------- processes


@needs_namespaces
def test_a_setsid_child_dies_with_the_tool(workspaces: Path) -> None:
    marker = f"cortex-isolation-{os.getpid()}-{time.monotonic_ns()}"
    code = ("import os\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            f"    os.execvp('sh', ['sh', '-c', 'sleep 30 # {marker}'])\n"
            "print('parent done')\n")
    assert lines(run_py(code, workspaces / "mine")) == ["parent", "done"]
    time.sleep(0.3)
    survivors = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(p, marker)]
    assert survivors == []


def _cmdline_has(pid: str, marker: str) -> bool:
    try:
        return marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@needs_namespaces
def test_exit_status_signals_limits_and_timeouts_come_through(workspaces: Path) -> None:
    assert run_py("raise SystemExit(7)", workspaces / "mine").returncode == 7
    for sig in ("SIGKILL", "SIGTERM", "SIGABRT"):
        killed = run_py(f"import os, signal; os.kill(os.getpid(), signal.{sig})",
                        workspaces / "mine")
        assert killed.killed_by == sig, (sig, killed)
    cpu = run_sandboxed([PY, "-c", "while True: pass"], cwd=workspaces / "mine", timeout=20,
                        limits=Limits(cpu_seconds=1),
                        isolation=Isolation(writable=workspaces / "mine",
                                            readable=interpreter_paths()))
    assert cpu.killed_by == "cpu_limit"
    slow = run_py("import time; time.sleep(30)", workspaces / "mine", timeout=0.5)
    assert slow.timed_out and slow.killed_by == "timeout" and slow.duration_s < 5
    echo = run_sandboxed(["cat"], stdin=b"through the relay", cwd=workspaces / "mine",
                         timeout=10, isolation=Isolation(writable=workspaces / "mine"))
    assert echo.stdout == b"through the relay"


@needs_namespaces
def test_a_set_up_failure_is_a_sandbox_error(workspaces: Path, tmp_path: Path) -> None:
    a_file = workspaces / "theirs" / "secret.txt"  # cannot be shown as an empty directory
    with pytest.raises(SandboxError, match="cannot set up the filesystem"):
        run_sandboxed(["true"], cwd=workspaces / "mine", timeout=10,
                      isolation=Isolation(writable=workspaces / "mine", hide=a_file))
    # a command that does not exist fails as it does without namespaces
    with pytest.raises(SandboxError, match="command not found"):
        run_sandboxed(["/nonexistent/tool"], cwd=workspaces / "mine", timeout=10,
                      isolation=Isolation(writable=workspaces / "mine",
                                          readable=(Path("/nonexistent/tool"),)))


# ---------------------------------------------------------------- privileges


@needs_namespaces
def test_without_a_user_every_capability_is_dropped(workspaces: Path) -> None:
    code = ("status = dict(l.split(':\\t') for l in open('/proc/self/status').read().splitlines()"
            " if ':\\t' in l)\n"
            "print(status['CapEff'], status['CapBnd'], status['NoNewPrivs'])\n")
    eff, bnd, nnp = lines(run_py(code, workspaces / "mine"))
    assert int(eff, 16) == 0 and int(bnd, 16) == 0 and nnp == "1"


@needs_namespaces
@needs_root
def test_as_the_sandbox_user_behind_a_closed_directory(workspaces: Path, tmp_path: Path) -> None:
    assert NOBODY is not None
    closed = tmp_path / "closed"
    (closed / "bin").mkdir(parents=True)
    (closed / "private.key").write_text("not for tools")
    script = closed / "bin" / "whoami.sh"
    script.write_text("#!/bin/sh\nid -u\nls /proc/1/root >/dev/null 2>&1 || echo no-root\n"
                      f"ls {closed}\ncat {closed}/private.key 2>&1 || true\n")
    script.chmod(0o755)
    closed.chmod(0o700)
    mine = workspaces / "mine"
    os.chown(mine, *NOBODY)
    result = run_sandboxed([str(script)], cwd=mine, timeout=10,
                           isolation=Isolation(writable=mine, hide=workspaces,
                                               readable=(script,), user=NOBODY))
    out = result.stdout.decode().splitlines()
    assert result.returncode == 0, result.stderr.decode()
    assert out[0] == str(NOBODY[0]) and out[1] == "no-root"
    assert out[2] == "bin"  # the closed directory shows only what the tool needs
    assert "No such file" in out[3]


SYSTEM_PYTHON = Path("/usr/bin/python3")
DRIVER = """
import subprocess, sys
from pathlib import Path
import isolation
ws = Path(sys.argv[1])
script = "id -u; (echo x > /tmp/cortex-userns-x) 2>&1; echo ok > out.txt; ls /proc | grep -c '^[0-9]'"
r = subprocess.run(["/bin/sh", "-c", script + "; ls " + str(ws.parent)], cwd=ws,
                   preexec_fn=isolation.plan(isolation.Isolation(writable=ws, hide=ws.parent)),
                   capture_output=True, env={"PATH": "/usr/bin:/bin"})
print(r.returncode, r.stdout.decode(), r.stderr.decode(), sep="\\n")
"""


@needs_root
@pytest.mark.skipif(not SYSTEM_PYTHON.exists(), reason="needs a system python3 any user may run")
def test_an_unprivileged_worker_isolates_through_a_user_namespace(tmp_path: Path) -> None:
    """A worker that is not root (here: nobody, running the stdlib-only isolation module with
    the system Python) gets the same isolation from an unprivileged user namespace."""
    assert NOBODY is not None
    base = Path(tempfile.mkdtemp(prefix="cortex-userns-"))  # pytest's tmp is closed to nobody
    try:
        base.chmod(0o755)
        (base / "mod").mkdir()
        shutil.copy(isolation.__file__, base / "mod" / "isolation.py")
        (base / "mod" / "driver.py").write_text(DRIVER)
        for path in (base / "mod", base / "mod" / "isolation.py", base / "mod" / "driver.py"):
            path.chmod(0o755)
        workspace = base / "ws"
        workspace.mkdir()
        os.chown(workspace, *NOBODY)
        result = subprocess.run([str(SYSTEM_PYTHON), str(base / "mod" / "driver.py"),
                                 str(workspace)], user=NOBODY[0], group=NOBODY[1],
                                extra_groups=[], capture_output=True, text=True, timeout=30,
                                cwd=base, env={"PATH": "/usr/bin:/bin"})
        if "cannot create namespaces" in result.stdout:
            pytest.skip(f"unprivileged user namespaces are off here: {result.stdout.strip()}")
        code, uid, denied, pids, listed, *_ = result.stdout.split("\n")
        assert code == "0", result
        assert uid == str(NOBODY[0])  # mapped to itself: files stay the worker's
        assert denied.endswith("Read-only file system")
        assert int(pids) <= 5  # the sandbox's own: init, sh, ls, grep
        assert listed == "ws"  # the module directory beside it is hidden
        assert (workspace / "out.txt").stat().st_uid == NOBODY[0]
    finally:
        shutil.rmtree(base)


@needs_namespaces
def test_a_signal_to_the_relay_ends_the_sandbox_as_that_signal(workspaces: Path) -> None:
    """The relay runs the default action, not the worker's Python handlers: SIGTERM to it
    ends the sandbox (its group is then killed), instead of being swallowed."""
    import signal
    import threading

    from cortex_worker.sandbox.process import live_groups

    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # a worker-like handler
    try:
        found: list[int] = []

        def terminate_soon() -> None:
            for _ in range(200):
                groups = live_groups()
                if groups:
                    time.sleep(0.3)  # the tool is running
                    found.extend(groups)
                    for group in groups:  # the relay alone: it leads the group
                        os.kill(group, signal.SIGTERM)
                    return
                time.sleep(0.01)

        thread = threading.Thread(target=terminate_soon)
        thread.start()
        result = run_py("import time; time.sleep(20)", workspaces / "mine", timeout=30)
        thread.join()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert found and result.killed_by == "SIGTERM" and result.duration_s < 10


def test_a_tool_worker_says_how_tools_are_isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    from cortex_worker.settings import Settings
    from cortex_worker.tools.sandboxed import describe_isolation

    assert describe_isolation(Settings(sandbox_isolation="off")) == (
        True, "tool sandbox: namespaces off (CORTEX_SANDBOX_ISOLATION=off)")
    monkeypatch.setattr(isolation, "unavailable_reason", lambda: "unshare: EPERM")
    ok, line = describe_isolation(Settings(sandbox_isolation="required"))
    assert not ok and "NO namespaces here (unshare: EPERM)" in line and "not starting" in line
    ok, line = describe_isolation(Settings(sandbox_isolation="auto"))
    assert ok and "tools see the worker's processes" in line
    monkeypatch.setattr(isolation, "unavailable_reason", lambda: None)
    ok, line = describe_isolation(Settings(sandbox_user=""))
    assert ok and "read-only filesystem but the job workspace" in line
    assert f"uid {os.geteuid()} without capabilities" in line
