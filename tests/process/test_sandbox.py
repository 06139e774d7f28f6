"""The subprocess sandbox (cortex_worker.sandbox): real processes, since they are the thing under test."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cortex_worker.sandbox import function_main as runner
from cortex_worker.sandbox import process, snippet
from cortex_worker.sandbox.process import SandboxError, kill_all, live_groups, run_sandboxed
from cortex_worker.tools.spec import Limits

pytestmark = pytest.mark.process

PY = sys.executable
REPO_ROOT = Path(__file__).resolve().parents[2]
TEST_MANIFESTS = REPO_ROOT / "tests" / "manifests"


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_gone(pid: int, within: float = 2.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.02)
    return False


def py(code: str, tmp_path: Path, **kwargs: object) -> process.SandboxResult:
    kwargs.setdefault("timeout", 10)
    return run_sandboxed([PY, "-c", code], cwd=tmp_path, **kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------- basics


def test_runs_in_the_workspace_with_output(tmp_path: Path) -> None:
    result = py("import os, sys; print(os.getcwd()); print('oops', file=sys.stderr)", tmp_path)
    assert result.ok and result.returncode == 0 and not result.timed_out
    assert result.stdout.decode().strip() == str(tmp_path)
    assert result.stderr == b"oops\n"
    assert result.killed_by is None and result.duration_s > 0


def test_minimal_environment_hides_worker_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CORTEX_SECRET_TOKEN", "hunter2")
    result = py(
        "import os, json; print(json.dumps(dict(os.environ)))", tmp_path, env={"EXTRA": "yes"}
    )
    env = json.loads(result.stdout)
    assert "CORTEX_SECRET_TOKEN" not in env and "hunter2" not in result.stdout.decode()
    assert env["PATH"] == "/usr/local/bin:/usr/bin:/bin"
    assert env["HOME"] == env["TMPDIR"] == str(tmp_path)
    assert env["LANG"] == "C.UTF-8" and env["EXTRA"] == "yes"


def test_stdin_is_fed_and_large_output_does_not_deadlock(tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024)
    result = run_sandboxed(["cat"], stdin=data, cwd=tmp_path, timeout=10)
    assert result.stdout == data and not result.stdout_truncated
    chatty = "import sys; sys.stdout.write('o' * 5_000_000); sys.stderr.write('e' * 5_000_000)"
    result = py(chatty, tmp_path, max_output_bytes=1000)
    assert result.returncode == 0
    assert result.stdout == b"o" * 1000 and result.stdout_truncated
    assert result.stderr == b"e" * 1000 and result.stderr_truncated


def test_rlimits_are_applied(tmp_path: Path) -> None:
    limits = Limits(cpu_seconds=7, memory_mb=300, processes=12, file_mb=3)
    text = run_sandboxed(["cat", "/proc/self/limits"], cwd=tmp_path, timeout=5, limits=limits)
    rows = {line[:26].strip(): line[26:].split() for line in text.stdout.decode().splitlines()[1:]}
    assert rows["Max cpu time"][:2] == ["7", "8"]
    assert rows["Max address space"][:2] == [str(300 * 2**20)] * 2
    assert rows["Max processes"][:2] == ["12", "12"]
    assert rows["Max file size"][:2] == [str(3 * 2**20)] * 2
    assert rows["Max core file size"][:2] == ["0", "0"]


def test_command_not_found_and_bad_cwd(tmp_path: Path) -> None:
    with pytest.raises(SandboxError, match="command not found: 'no-such-tool-xyz'"):
        run_sandboxed(["no-such-tool-xyz"], cwd=tmp_path, timeout=1)
    with pytest.raises(SandboxError, match="does not exist"):
        run_sandboxed(["true"], cwd=tmp_path / "missing", timeout=1)
    with pytest.raises(SandboxError, match="empty command"):
        run_sandboxed([], cwd=tmp_path, timeout=1)


# ---------------------------------------------------------------- killing


GRANDCHILD = """
import subprocess, time, os
child = subprocess.Popen(["sleep", "60"])
open("pids", "w").write(f"{os.getpid()} {child.pid}")
time.sleep(60)
"""


def test_timeout_kills_the_whole_group(tmp_path: Path) -> None:
    result = py(GRANDCHILD, tmp_path, timeout=1.0)
    # the timeout ended it, not the minute's sleep (after which it would exit 0, unkilled)
    assert result.timed_out and result.killed_by == "timeout" and not result.ok
    assert result.returncode == -signal.SIGKILL
    leader, grandchild = map(int, (tmp_path / "pids").read_text().split())
    assert wait_gone(leader) and wait_gone(grandchild)
    assert live_groups() == frozenset()


def test_background_children_die_when_the_leader_exits(tmp_path: Path) -> None:
    result = run_sandboxed(
        ["sh", "-c", "sleep 3600 & echo $! > bg.pid; echo done"], cwd=tmp_path, timeout=60
    )
    # the background job holds stdout for an hour: had the run waited for it, its timeout
    # would have ended it (timed_out); it ended with the leader
    assert result.ok and not result.timed_out and result.killed_by is None
    assert result.stdout == b"done\n"
    assert wait_gone(int((tmp_path / "bg.pid").read_text()))


def test_without_pidfd_the_exit_is_polled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process._Capture, "_pidfd", lambda self: None)
    result = run_sandboxed(
        ["sh", "-c", "sleep 60 & echo $! > bg.pid; echo done"], cwd=tmp_path, timeout=20
    )
    assert result.ok and result.stdout == b"done\n"
    assert wait_gone(int((tmp_path / "bg.pid").read_text()))
    result = run_sandboxed(["sleep", "60"], cwd=tmp_path, timeout=0.3)
    assert result.timed_out and result.duration_s < 2


def test_memory_limit_fails_cleanly(tmp_path: Path) -> None:
    result = py("x = bytearray(2 * 1024**3)", tmp_path, limits=Limits(memory_mb=256))
    assert result.returncode == 1 and not result.timed_out
    assert b"MemoryError" in result.stderr


def test_file_size_limit(tmp_path: Path) -> None:
    code = "open('big', 'wb').write(b'x' * 3 * 1024 * 1024)"
    result = py(code, tmp_path, limits=Limits(file_mb=1))
    assert result.returncode == 1 and b"File too large" in result.stderr
    assert (tmp_path / "big").stat().st_size <= 1024 * 1024


def test_cpu_limit(tmp_path: Path) -> None:
    result = py("while True: pass", tmp_path, limits=Limits(cpu_seconds=1))
    assert result.killed_by == "cpu_limit" and not result.timed_out


def test_kill_all_stops_running_sandboxes(tmp_path: Path) -> None:
    results: list[process.SandboxResult] = []
    thread = threading.Thread(
        target=lambda: results.append(run_sandboxed(["sleep", "30"], cwd=tmp_path, timeout=30))
    )
    thread.start()
    deadline = time.monotonic() + 5
    while not live_groups() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kill_all() == 1
    thread.join(5)
    assert results and results[0].killed_by == "shutdown" and not results[0].timed_out


def test_sigterm_handler_kills_sandboxes_then_chains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = signal.getsignal(signal.SIGTERM)
    called: list[int] = []
    results: list[process.SandboxResult] = []
    process.install_sigterm_handler.cache_clear()  # as in a process that never installed it
    try:
        signal.signal(signal.SIGTERM, lambda signum, frame: called.append(signum))
        process.install_sigterm_handler()
        process.install_sigterm_handler()  # idempotent
        thread = threading.Thread(
            target=lambda: results.append(run_sandboxed(["sleep", "30"], cwd=tmp_path, timeout=30))
        )
        thread.start()
        deadline = time.monotonic() + 5
        while not live_groups() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
        thread.join(5)
    finally:
        signal.signal(signal.SIGTERM, original)
        process.install_sigterm_handler.cache_clear()
    assert called == [signal.SIGTERM]
    assert results and results[0].killed_by == "shutdown"


# ---------------------------------------------------------------- runner


def run_runner(
    entrypoint: str, params: object, tmp_path: Path
) -> tuple[dict, process.SandboxResult]:
    result = run_sandboxed(
        [PY, "-m", "cortex_worker.sandbox.function_main", entrypoint],
        stdin=json.dumps(params).encode(),
        cwd=tmp_path,
        timeout=10,
        env={
            "PYTHONPATH": f"{TEST_MANIFESTS}{os.pathsep}{REPO_ROOT}",
            "PYTHONDONTWRITEBYTECODE": "1",
        },
    )
    line = runner.parse_last_line(result.stdout)
    assert line is not None, result
    return line, result


def test_runner_subprocess_success_and_failure(tmp_path: Path) -> None:
    line, result = run_runner("testtools:api_call", {"endpoint": "/data"}, tmp_path)
    assert line["ok"] is True and line["result"]["endpoint"] == "/data"
    line, result = run_runner("testtools:fail", {"message": "boom"}, tmp_path)
    assert line == {"ok": False, "error": "boom", "type": "RuntimeError", "stdout": ""}
    assert b"Traceback" in result.stderr and result.returncode == 0


def test_runner_result_line_survives_raw_writes(tmp_path: Path) -> None:
    (tmp_path / "rawtool.py").write_text(
        "import os\ndef go():\n    os.write(1, b'raw, no newline')\n    return 1\n"
    )
    result = run_sandboxed(
        [PY, "-m", "cortex_worker.sandbox.function_main", "rawtool:go"],
        stdin=b"{}",
        cwd=tmp_path,
        timeout=10,
        env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO_ROOT}", "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert result.stdout.startswith(b"raw, no newline\n")
    assert runner.parse_last_line(result.stdout) == {"ok": True, "result": 1, "stdout": ""}


def test_runner_steps_aside_for_the_worker_once_its_answer_is_out(tmp_path: Path) -> None:
    """The tool runs at the caller's priority; its process's exit, after the answer, at nice
    19 (the worker reading the answer runs first). A plain subprocess: nothing kills it, so
    its atexit handler runs and says how nice it was."""
    (tmp_path / "nicetool.py").write_text(
        "import atexit, os, sys\n"
        "atexit.register(lambda: open(sys.argv[-1] + '.exit', 'w').write(str(os.nice(0))))\n"
        "def go():\n    return os.nice(0)\n")
    done = subprocess.run(
        [PY, "-m", "cortex_worker.sandbox.function_main", "nicetool:go"], input=b"{}", cwd=tmp_path,
        capture_output=True, timeout=20,
        env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO_ROOT}", "PYTHONDONTWRITEBYTECODE": "1"})
    before = os.nice(0)
    assert runner.parse_last_line(done.stdout) == {"ok": True, "result": before, "stdout": ""}
    assert (tmp_path / "nicetool:go.exit").read_text() == str(min(before + 19, 19))


def test_the_answer_comes_after_the_end_of_stderr_and_with_the_end_of_stdout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stderr ends before the answer line is written and stdout right after it, so the worker
    that reads the answer finds both ends with it (one wake, not two more)."""
    (tmp_path / "quiettool.py").write_text(
        "import sys\ndef go():\n    print('to stderr', file=sys.stderr)\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    steps: list[str] = []

    class Out(io.StringIO):
        def write(self, text: str) -> int:
            steps.append("answer" if runner.parse_last_line(text.encode()) else "print")
            return super().write(text)

    monkeypatch.setattr(sys, "stdin", io.StringIO("{}"))
    monkeypatch.setattr(sys, "stdout", Out())
    monkeypatch.setattr(runner, "_end", lambda fd: steps.append(f"end {fd}"))
    monkeypatch.setattr(runner.os, "nice", lambda increment: steps.append("nice") or 19)
    assert runner.main(["quiettool:go"]) == 0
    assert steps == ["end 2", "answer", "end 1", "nice"]


def test_a_read_takes_what_is_there_and_the_end_with_it() -> None:
    """The capture loop reads a stream until it would block, so output that ended right after
    its last write is done in one wake."""
    import selectors

    read, write = os.pipe()
    os.write(write, b"answer\n")
    os.close(write)
    os.set_blocking(read, False)
    sel = selectors.DefaultSelector()
    key = sel.register(read, selectors.EVENT_READ, "out")
    capture = process._Capture(None, None, time.monotonic() + 5, 1024)  # type: ignore[arg-type]
    capture._handle(sel, key)
    assert bytes(capture.out) == b"answer\n"
    assert sel.get_map() == {}  # the end was read in the same call
    os.close(read)


@pytest.fixture
def in_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> Callable[[str, object], tuple[str, dict]]:
    """Run runner.main in this process; returns (stdout text, result line)."""
    (tmp_path / "rtools.py").write_text(
        "def shout(text):\n    print('said', text, end='')\n    return text.upper()\n"
        "def returns_set():\n    return {1, 2}\n"
        "async def later(x):\n    return x * 2\n"
        "def quits():\n    raise SystemExit(3)\n"
        "VALUE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    # a tool process ends its output and lowers its priority once it answered; this one is
    # pytest's, which goes on (it ran the rest of the suite at nice 19)
    monkeypatch.setattr(runner, "_end", lambda fd: None)
    monkeypatch.setattr(runner.os, "nice", lambda increment: os.getpriority(os.PRIO_PROCESS, 0))

    def call(entrypoint: str, params: object) -> tuple[str, dict]:
        monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(params)))
        assert runner.main([entrypoint]) == 0
        text = capsys.readouterr().out
        line = runner.parse_last_line(text.encode())
        assert line is not None and text.endswith("\n")
        return text, line

    return call


def test_runner_captures_prints_and_reports_errors(
    in_process: Callable[[str, object], tuple[str, dict]],
) -> None:
    text, line = in_process("rtools:shout", {"text": "hi"})
    assert text.startswith("said hi\n")  # the prints come first, the result line last
    assert line == {"ok": True, "result": "HI", "stdout": "said hi"}
    assert in_process("rtools:later", {"x": 21})[1]["result"] == 42
    line = in_process("rtools:shout", {"wrong": 1})[1]
    assert line["ok"] is False and line["type"] == "TypeError" and "wrong" in line["error"]
    line = in_process("rtools:returns_set", {})[1]
    assert line["ok"] is False and "not JSON-serializable" in line["error"]
    assert in_process("rtools:quits", {})[1]["error"] == "the tool called sys.exit(3)"
    assert (
        in_process("rtools:missing", {})[1]["error"] == "module 'rtools' has no function 'missing'"
    )
    assert in_process("rtools:VALUE", {})[1]["error"] == "rtools:VALUE is not callable"
    line = in_process("nosuchmodule_xyz:f", {})[1]
    assert line["type"] == "ModuleNotFoundError"
    assert "module:function" in in_process("not an entrypoint", {})[1]["error"]
    assert "JSON object" in in_process("rtools:shout", [1, 2])[1]["error"]


def test_parse_last_line() -> None:
    assert runner.parse_last_line(b'noise\n{"ok": true, "result": 1}\n') == {
        "ok": True,
        "result": 1,
    }
    assert runner.parse_last_line(b'{"ok": true}\nnot json\n') is None
    assert runner.parse_last_line(b"") is None
    assert runner.parse_last_line(b'{"no": "ok key"}') is None


# ---------------------------------------------------------------- snippet


def test_snippet_last_expression_and_errors() -> None:
    assert snippet.run("x = 6\nx * 7") == 42
    assert snippet.run("x = 1") is None
    assert snippet.jsonable({1, 2}) == "{1, 2}" and snippet.jsonable([1]) == [1]
    with pytest.raises(ZeroDivisionError) as info:
        snippet.run("1/0")
    assert snippet.describe(info.value) == "ZeroDivisionError: division by zero"
    with pytest.raises(SyntaxError) as syntax:
        snippet.run("\ndef f(:")
    assert snippet.describe(syntax.value).endswith("(line 2)")
