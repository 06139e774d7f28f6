"""Warm runners (cortex_worker.sandbox.warm, zygote): python tools forked from a zygote keep
every guarantee of the cold sandbox. Real processes and namespaces throughout; the isolated
cases are skipped where the kernel refuses namespaces (CI runs as root, where they work)."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cortex_worker.sandbox import isolation, warm, zygote
from cortex_worker.sandbox.function_main import parse_last_line
from cortex_worker.sandbox.isolation import Isolation, interpreter_paths
from cortex_worker.sandbox.process import (
    SandboxError,
    SandboxResult,
    kill_all,
    live_groups,
    sandbox_env,
)
from cortex_worker.sandbox.warm import RUNNER, run_warm
from cortex_worker.tools.spec import Limits
from tests import harness

pytestmark = pytest.mark.process

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
NOBODY = isolation.sandbox_user("nobody")
ENV = {"PYTHONPATH": f"{HERE}{os.pathsep}{REPO_ROOT}", "PYTHONDONTWRITEBYTECODE": "1",
       "PYTHONIOENCODING": "utf-8"}
needs_namespaces = pytest.mark.skipif(
    isolation.unavailable_reason() is not None,
    reason=f"namespaces unavailable here: {isolation.unavailable_reason()}")


@pytest.fixture
def root() -> Iterator[Path]:
    """A workspace root with two jobs' workspaces, open to the sandbox user."""
    base = Path(tempfile.mkdtemp(prefix="cortex-warm-"))  # pytest's own is closed (0700)
    base.chmod(0o755)
    for job in ("job-a", "job-b"):
        (base / job).mkdir()
        if NOBODY is not None:
            os.chown(base / job, *NOBODY)
    (base / "job-b" / "secret.txt").write_text("job b's file")
    yield base
    shutil.rmtree(base)


def iso(root: Path, job: str = "job-a", **options: Any) -> Isolation:
    return Isolation(writable=root / job, hide=root, user=NOBODY,
                     readable=(*interpreter_paths(), HERE, REPO_ROOT), **options)


def run(function: str, params: dict[str, Any] | None = None, *, cwd: Path,
        isolation: Isolation | None, timeout: float = 20, limits: Limits | None = None,
        env: dict[str, str] | None = None) -> SandboxResult:
    argv = [sys.executable, "-P", "-s", "-m", RUNNER, f"warm_tools:{function}"]
    return run_warm(argv, stdin=json.dumps(params or {}).encode(), cwd=cwd, timeout=timeout,
                    limits=limits, env={**ENV, **(env or {})}, isolation=isolation)


def result(res: SandboxResult) -> Any:
    line = parse_last_line(res.stdout)
    assert line is not None and line["ok"], (res, res.stderr.decode())
    return line["result"]


def call(function: str, params: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    return result(run(function, params, **kwargs))


def gone(pid: int, within: float = 3.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.02)
    return False


# ---------------------------------------------------------------- warm, and isolated per call


@needs_namespaces
def test_each_warm_call_gets_its_own_namespaces_user_and_processes(root: Path) -> None:
    # Both calls alive at once: a namespace's inode number is reused once it is freed, so two
    # calls one after the other could show the same number for two namespaces.
    job = root / "job-a"
    results: dict[str, Any] = {}

    def held(name: str) -> None:
        results[name] = call("whoami_held", {"marker": f"{name}.here", "release": "release"},
                             cwd=job, isolation=iso(root), timeout=90)

    threads = [threading.Thread(target=held, args=(name,)) for name in ("first", "second")]
    for thread in threads:
        thread.start()
    try:
        harness.wait_until(lambda: all((job / f"{n}.here").exists() for n in ("first", "second")),
                           timeout=90, interval=0.01, message="the two calls never ran together")
    finally:
        (job / "release").write_text("")
        for thread in threads:
            thread.join(90)
    first, second = results["first"], results["second"]
    assert first["imported_in"] == second["imported_in"] != first["pid"]  # one zygote, warm
    mine = {ns: os.readlink(f"/proc/self/ns/{ns}") for ns in first["namespaces"]}
    for ns, link in first["namespaces"].items():
        assert link != mine[ns] and link != second["namespaces"][ns], ns  # fresh per call
    assert (first["pid"], first["ppid"], first["pids"]) == (2, 1, ["1", "2"])  # init and itself
    assert first["uid"] == (NOBODY[0] if NOBODY else os.geteuid())
    assert first["cwd"] == str(root / "job-a")
    assert first["fds"] == [0, 1, 2, 3]  # its pipes, and the one listing /proc/self/fd


def test_a_call_that_changes_module_globals_does_not_change_the_next(root: Path) -> None:
    for isolated in (None, *([iso(root)] if isolation.unavailable_reason() is None else [])):
        assert [call("remember", {"value": i}, cwd=root / "job-a", isolation=isolated)
                for i in range(3)] == [1, 1, 1]


@needs_namespaces
def test_only_the_calls_workspace_is_writable_and_other_jobs_are_hidden(root: Path,
                                                                         tmp_path: Path) -> None:
    outside = [str(tmp_path / "escape"), "/etc/cortex-warm", "/tmp/cortex-warm",
               "/dev/shm/cortex-warm"]
    for job, other in (("job-a", "job-b"), ("job-b", "job-a")):  # job-b: the spare of job-a
        mine = str(root / job / "mine.txt")
        wrote = call("write", {"paths": [*outside, str(root / other / "x"), mine]}, cwd=root / job,
                     isolation=iso(root, job))
        assert wrote.pop(mine) == "wrote" and (root / job / "mine.txt").read_text() == "x"
        assert set(wrote.values()) <= {"Read-only file system", "Permission denied",
                                       "No such file or directory"}, wrote
        assert call("listdir", {"path": str(root)}, cwd=root / job,
                    isolation=iso(root, job)) == [job]
    assert not (tmp_path / "escape").exists() and not Path("/tmp/cortex-warm").exists()


def test_the_environment_is_the_calls_own(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORTEX_WARM_SECRET", "hunter2")
    env = call("whoami", cwd=root / "job-a", isolation=None, env={"EXTRA": "yes"})["env"]
    assert env == sandbox_env(root / "job-a", {**ENV, "EXTRA": "yes"})


@pytest.mark.parametrize("isolated", [False, pytest.param(True, marks=needs_namespaces)])
def test_ps_shows_a_warm_call_as_a_cold_one(root: Path, isolated: bool) -> None:
    """Seen from outside, as `ps` and `ps e` see it, a warm call's /proc/PID/cmdline is the
    cold runner's command and its /proc/PID/environ its own environment (not its zygote's):
    an operator, or a test, finds an attempt's process by its CORTEX_* variables either way."""
    job = root / "job-a"
    mark = f"job-ps-{os.getpid()}-{time.monotonic_ns()}"
    argv = [sys.executable, "-P", "-s", "-m", RUNNER, "warm_tools:whoami_held"]
    results: list[SandboxResult] = []

    def held() -> None:
        results.append(run_warm(
            argv, stdin=json.dumps({"marker": "ps.here", "release": "ps.release"}).encode(),
            cwd=job, timeout=90, env=ENV, call_env={"CORTEX_JOB_ID": mark},
            isolation=iso(root) if isolated else None))

    def marked() -> list[str]:
        return [p for p in os.listdir("/proc") if p.isdigit()
                and f"CORTEX_JOB_ID={mark}".encode() in _read(f"/proc/{p}/environ")]

    thread = threading.Thread(target=held)
    thread.start()
    try:
        harness.wait_until(lambda: (job / "ps.here").exists(), timeout=90, interval=0.01,
                           message="the call never ran")
        (pid,) = marked()  # the tool process only (not its relay or init, not the zygote)
        cmdline, environ = _read(f"/proc/{pid}/cmdline"), _read(f"/proc/{pid}/environ")
    finally:
        (job / "ps.release").write_text("")
        thread.join(90)
    seen = result(results[0])
    assert seen["imported_in"] != seen["pid"]  # warm: forked from the zygote
    assert cmdline.split(b"\0")[:-1] == [os.fsencode(a) for a in argv]
    assert sorted(environ.split(b"\0")[:-1]) == sorted(
        f"{k}={v}".encode() for k, v in sandbox_env(job, {**ENV, "CORTEX_JOB_ID": mark}).items())
    assert seen["env"] == sandbox_env(job, {**ENV, "CORTEX_JOB_ID": mark})


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:  # gone meanwhile
        return b""


@needs_namespaces
def test_rlimits_apply_and_a_breach_retires_the_zygote(root: Path) -> None:
    limits = Limits(cpu_seconds=1, memory_mb=300, processes=12, file_mb=3)
    text = call("limits", cwd=root / "job-a", isolation=iso(root), limits=limits)
    rows = {line[:26].strip(): line[26:].split() for line in text.splitlines()[1:]}
    assert rows["Max cpu time"][:2] == ["1", "2"]
    assert rows["Max address space"][:2] == [str(300 * 2**20)] * 2
    assert rows["Max processes"][:2] == ["12", "12"]
    assert rows["Max file size"][:2] == [str(3 * 2**20)] * 2
    assert rows["Max core file size"][:2] == ["0", "0"]
    before = call("whoami", cwd=root / "job-a", isolation=iso(root))["imported_in"]
    spun = run("spin", cwd=root / "job-a", isolation=iso(root), limits=limits)
    assert spun.killed_by == "cpu_limit" and not spun.timed_out
    after = call("whoami", cwd=root / "job-a", isolation=iso(root))["imported_in"]
    assert after != before and gone(before)


# ---------------------------------------------------------------- the spare takes the call


def offered(env: dict[str, str]) -> int:
    """The spare the zygote of `env` offers now (waits for its offer)."""
    server = warm._zygotes[warm_key("whoami", env)]
    deadline = time.monotonic() + 5
    while True:
        with server.lock:
            server._read_offers()
            if server.spare is not None:
                return server.spare.pid
        assert time.monotonic() < deadline, "no spare was offered"
        time.sleep(0.01)


def test_a_call_goes_straight_to_the_spare_it_was_offered(root: Path) -> None:
    """The zygote offers each spare to the worker, which sends it the next call itself (the
    zygote is off the call's path); a call through the zygote never takes an offered spare."""
    env = {"WARM_TOOLS_CASE": "offered"}
    first = call("whoami", cwd=root / "job-a", isolation=None, env=env)
    for _ in range(3):
        spare = offered(env)
        who = call("whoami", cwd=root / "job-a", isolation=None, env=env)
        assert who["pid"] == spare and who["imported_in"] == first["imported_in"]


def test_a_spare_that_died_while_offered_is_passed_over(root: Path) -> None:
    env = {"WARM_TOOLS_CASE": "dead-spare"}
    call("whoami", cwd=root / "job-a", isolation=None, env=env)
    spare = offered(env)
    os.killpg(spare, signal.SIGKILL)
    assert gone(spare)
    who = call("whoami", cwd=root / "job-a", isolation=None, env=env)
    assert who["pid"] != spare  # a child the zygote forked for the call
    spare = offered(env)  # and the spare after it serves the next
    assert call("whoami", cwd=root / "job-a", isolation=None, env=env)["pid"] == spare


@needs_namespaces
def test_a_call_that_does_not_fit_the_spare_goes_through_the_zygote(root: Path) -> None:
    """A workspace of another parent: the zygote forks a child for the call and drops the
    spare, whose offer then fails over to the zygote too (it is dead)."""
    env = {"WARM_TOOLS_CASE": "misfit"}
    call("whoami", cwd=root / "job-a", isolation=iso(root), env=env)
    spare = offered(env)
    other = Path(tempfile.mkdtemp(prefix="cortex-warm-other-"))
    try:
        other.chmod(0o755)
        (other / "job").mkdir()
        if NOBODY is not None:
            os.chown(other / "job", *NOBODY)
        elsewhere = Isolation(writable=other / "job", hide=other, user=NOBODY,
                              readable=(*interpreter_paths(), HERE, REPO_ROOT))
        who = call("whoami", cwd=other / "job", isolation=elsewhere, env=env)
        assert who["cwd"] == str(other / "job")
        assert gone(spare)
        server = warm._zygotes[warm_key("whoami", env)]
        dead_end, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        peer.close()  # as the dropped spare's end is
        with server.lock:  # its offer, as if the worker read it only now
            server.spare = zygote.Spare(spare, dead_end, iso(root))
        again = call("whoami", cwd=root / "job-a", isolation=iso(root), env=env)
        assert again["cwd"] == str(root / "job-a")
        assert again["imported_in"] == who["imported_in"]  # through the same zygote
    finally:
        shutil.rmtree(other)


def test_a_spare_dropped_as_it_took_the_call_is_killed_and_the_call_retried(root: Path) -> None:
    """If the zygote had dropped the spare by the time it learnt that the worker gave it a
    call (a race with a call through the zygote), the process the worker gave the call to
    is killed, and the call runs on a fresh zygote."""
    env = {"WARM_TOOLS_CASE": "stale"}
    first = call("whoami", cwd=root / "job-a", isolation=None, env=env)
    offered(env)
    server = warm._zygotes[warm_key("whoami", env)]
    decoy = subprocess.Popen(["sleep", "60"], start_new_session=True)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with server.lock:  # an offer of a process the zygote does not know as its spare
            assert server.spare is not None
            server.spare.sock.close()
            server.spare = zygote.Spare(decoy.pid, ours, None)
        who = call("whoami", cwd=root / "job-a", isolation=None, env=env)
        assert who["imported_in"] != first["imported_in"]  # the call ran on a new zygote
        assert decoy.wait(timeout=5) == -signal.SIGKILL
    finally:
        decoy.kill()
        theirs.close()


def test_calls_at_once_on_one_zygote_each_get_their_own_process(root: Path) -> None:
    env = {"WARM_TOOLS_CASE": "at-once"}
    call("whoami", cwd=root / "job-a", isolation=None, env=env)
    barrier = threading.Barrier(6)

    def one(_: int) -> dict[str, Any]:
        barrier.wait()
        return call("whoami", cwd=root / "job-a", isolation=None, env=env)

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(6) as pool:
        seen = list(pool.map(one, range(6)))
    assert len({who["pid"] for who in seen}) == 6
    assert len({who["imported_in"] for who in seen}) == 1


# ---------------------------------------------------------------- killing


@pytest.mark.parametrize("isolated", [False, pytest.param(True, marks=needs_namespaces)])
def test_a_timeout_kills_the_call_and_everything_it_started(root: Path, isolated: bool) -> None:
    marker = f"cortex-warm-{os.getpid()}-{time.monotonic_ns()}"
    # in namespaces even a child that left the call's session dies (its PID namespace ends)
    res = run("linger", {"marker": marker, "setsid": isolated}, cwd=root / "job-a",
              isolation=iso(root) if isolated else None, timeout=1.5)
    # the timeout ended it, not the minute `linger` sleeps: killed by the timer, and without
    # the answer line `linger` would have printed once its sleep was over
    assert res.timed_out and res.killed_by == "timeout"
    assert parse_last_line(res.stdout) is None, res.stdout
    survivors = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(p, marker)]
    deadline = time.monotonic() + 3
    while survivors and time.monotonic() < deadline:
        time.sleep(0.05)
        survivors = [p for p in survivors if not gone(int(p), 0)]
    assert survivors == []
    assert live_groups() == frozenset()


@pytest.mark.parametrize("cold", [False, True])
@needs_namespaces
def test_an_answered_call_returns_at_once_and_its_sandbox_is_still_killed_and_reaped(
        root: Path, cold: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The call ends when the runner's answer is out (its init and relay exit later): what
    the tool left behind dies all the same, and every process of the call is reaped."""
    env = {"WARM_TOOLS_CASE": f"detach-{cold}"}  # a zygote of its own
    if cold:
        monkeypatch.setitem(warm._cold, warm_key("detach", env), "this test runs it cold")
    marker = f"cortex-warm-detach-{os.getpid()}-{time.monotonic_ns()}"
    before = _zombies()  # earlier tests' retired zygotes, say
    res = run("detach", {"marker": marker}, cwd=root / "job-a", isolation=iso(root), env=env)
    assert (result(res), res.returncode, res.killed_by) == ("done", 0, None)
    assert live_groups() == frozenset()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (_with_marker(marker) or _zombies() - before):
        time.sleep(0.02)
    assert _with_marker(marker) == [] and _zombies() - before == set()


@needs_namespaces
@pytest.mark.parametrize("cold", [False, True])
def test_a_call_ends_when_its_answer_is_out_not_when_its_process_exits(
        root: Path, cold: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner ends stdout and stderr once its answer line is out: the call returns then,
    not after the process's exit (an atexit handler, an interpreter's shutdown), and what is
    written after the answer is dropped instead of breaking it."""
    env = {"WARM_TOOLS_CASE": f"slow-exit-{cold}"}
    if cold:
        monkeypatch.setitem(warm._cold, warm_key("slow_exit", env), "this test runs it cold")
    # the exit takes an hour, the call's timeout is 20 s: had the call waited for the exit,
    # its timeout would have killed it (killed_by "timeout"); it returned on the answer
    res = run("slow_exit", {"seconds": 3600}, cwd=root / "job-a", isolation=iso(root), env=env,
              timeout=20)
    assert (result(res), res.returncode, res.killed_by, res.timed_out) == \
        ("answered", 0, None, False)
    assert b"after the answer" not in res.stdout + res.stderr
    assert live_groups() == frozenset()  # the exiting process was killed with its group


def warm_key(function: str, env: dict[str, str]) -> warm.Key:
    """The zygote key `run` uses for `warm_tools:function` with `env`."""
    return ((sys.executable, "-P", "-s", "-m", "warm_tools"), tuple(sorted({**ENV, **env}.items())))


def _with_marker(marker: str) -> list[str]:
    return [p for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(p, marker)
            and not gone(int(p), 0)]


def _zombies() -> set[int]:
    """Zombie processes whose parent is this process or one of its zygotes (not counting
    zygotes that exited: a retired one is reaped at the next call)."""
    zygotes = {z.proc.pid for z in [*warm._zygotes.values(), *warm._retired]}
    parents = {os.getpid(), *zygotes}
    found = set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) in parents and int(pid) not in zygotes:
            found.add(int(pid))
    return found


def _cmdline_has(pid: str, marker: str) -> bool:
    try:
        return marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


WORKER = """
import json, sys
from pathlib import Path
from cortex_worker.sandbox.warm import RUNNER, run_warm
run_warm([sys.executable, "-P", "-s", "-m", RUNNER, "warm_tools:linger"], cwd=Path(sys.argv[1]),
         stdin=json.dumps({"marker": sys.argv[2]}).encode(), timeout=60, env=json.loads(sys.argv[3]))
"""


def test_a_call_dies_with_the_worker_that_made_it(root: Path) -> None:
    marker = f"cortex-warm-worker-{os.getpid()}-{time.monotonic_ns()}"
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(root / "job-a"), marker,
                               json.dumps(ENV)], cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 20
        while not (root / "job-a" / "pids").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        tool, child = map(int, (root / "job-a" / "pids").read_text().split())
    finally:
        worker.kill()
        worker.wait()
    assert gone(tool) and gone(child)  # the zygote killed the call's group


def test_kill_all_stops_warm_calls(root: Path) -> None:
    results: list[SandboxResult] = []
    thread = threading.Thread(target=lambda: results.append(
        run("linger", {"marker": "kill-all"}, cwd=root / "job-a", isolation=None)))
    thread.start()
    deadline = time.monotonic() + 10
    while not live_groups() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kill_all() == 1
    thread.join(10)
    assert results and results[0].killed_by == "shutdown"


# ---------------------------------------------------------------- zygotes come and go


def test_a_zygote_is_recycled_after_n_calls(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warm, "RECYCLE_AFTER", 2)
    env = {"WARM_TOOLS_CASE": "recycle"}  # a zygote of its own
    seen = [call("whoami", cwd=root / "job-a", isolation=None, env=env)["imported_in"]
            for _ in range(3)]
    assert seen[0] == seen[1] != seen[2]


def test_a_dead_zygote_is_replaced(root: Path) -> None:
    env = {"WARM_TOOLS_CASE": "crash"}
    first = call("whoami", cwd=root / "job-a", isolation=None, env=env)
    assert first["ppid"] == first["imported_in"]  # forked by the zygote, without namespaces
    os.kill(first["imported_in"], signal.SIGKILL)
    assert gone(first["imported_in"])
    second = call("whoami", cwd=root / "job-a", isolation=None, env=env)
    assert second["imported_in"] not in (first["imported_in"], second["pid"])


def test_a_call_sent_as_its_zygote_dies_is_not_left_waiting(root: Path) -> None:
    """A zygote dead while its control socket lives on elsewhere (in a spare that is dying
    with it) took the request and never answered, and the kernel released the call's socket
    only later: the call waited for its whole timeout. It is replaced at once instead. Here the
    test holds the socket (`pidfd_getfd`) where a slow-dying spare did under load."""
    env = {"WARM_TOOLS_CASE": "held"}
    first = call("whoami", cwd=root / "job-a", isolation=None, env=env)
    zygote = first["imported_in"]
    argv = Path(f"/proc/{zygote}/cmdline").read_bytes().split(b"\0")
    control = int(argv[argv.index(warm.ZYGOTE.encode()) + 1])
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(zygote)
    held = libc.syscall(438, pidfd, control, 0)  # pidfd_getfd
    os.close(pidfd)
    assert held >= 0, os.strerror(ctypes.get_errno())
    try:
        os.kill(zygote, signal.SIGKILL)
        assert gone(zygote)
        res = run("whoami", cwd=root / "job-a", isolation=None, env=env, timeout=60)
        assert not res.timed_out and res.killed_by is None  # answered, not ended by the timeout
        second = result(res)
        assert second["imported_in"] != zygote  # by a new zygote
    finally:
        os.close(held)


def test_a_module_that_starts_threads_when_imported_runs_cold(root: Path) -> None:
    env = {"WARM_TOOLS_THREAD": "1"}
    for _ in range(2):
        who = call("whoami", cwd=root / "job-a", isolation=None, env=env)
        assert who["imported_in"] == who["pid"]  # imported by the call's own interpreter
    assert any("starts threads" in reason for reason in warm._cold.values())


@needs_namespaces
def test_a_set_up_failure_is_a_sandbox_error(root: Path) -> None:
    not_a_directory = root / "job-b" / "secret.txt"
    with pytest.raises(SandboxError, match="cannot set up the filesystem"):
        run("whoami", cwd=root / "job-a", isolation=Isolation(
            writable=root / "job-a", hide=not_a_directory, user=NOBODY,
            readable=(*interpreter_paths(), HERE, REPO_ROOT)))
    assert call("whoami", cwd=root / "job-a", isolation=iso(root))["cwd"] == str(root / "job-a")
