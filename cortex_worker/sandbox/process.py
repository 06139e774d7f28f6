"""Run a command in a sandboxed subprocess: own process group, rlimits, minimal env, capped output.

What the sandbox guarantees:

- the command runs in its own session and process group (`start_new_session`); on timeout,
  and whenever the leader exits, the whole group gets SIGKILL, so background children and
  grandchildren never outlive the call;
- rlimits (set in the child before `exec`): RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC,
  RLIMIT_FSIZE, and RLIMIT_CORE = 0;
- the environment is built from scratch (PATH, LANG, HOME = TMPDIR = cwd, plus `env`): the
  worker's own variables, secrets included, are never inherited;
- stdout and stderr are drained concurrently (no deadlock with a chatty process) and
  truncated beyond `max_output_bytes` each.

With `isolation` (cortex_worker/sandbox/isolation.py) it also runs in namespaces of its own:
only its own processes in /proc, everything read-only but the workspace, no network, as an
unprivileged user (or without capabilities), and nothing it starts outlives it, `setsid()`
or not.

What it does not guarantee:

- RLIMIT_NPROC counts every process of the real user, and root (or CAP_SYS_RESOURCE) is
  exempt from it: for a shared sandbox user it may bind too early. Fork bombs are contained
  by the wall-clock timeout and by killing the whole group (the whole PID namespace).
- Without `isolation`, a process that calls `setsid()` leaves the group and escapes the
  group kill.
- `preexec_fn` is documented as unsafe with threads; ours calls `os.setrlimit` and the
  namespace set-up with precomputed values and forks only from the single-threaded child.

If the worker receives SIGTERM while sandboxes run (a Celery revoke with `terminate=True`),
their groups must die too: call `install_sigterm_handler()` once at worker start-up, or
`kill_all()` from your own handler.
"""

from __future__ import annotations

import contextlib
import os
import resource
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING, Protocol

from cortex_worker.errors import CortexError
from cortex_worker.sandbox.isolation import Isolation, setup_error
from cortex_worker.sandbox.isolation import plan as isolation_plan

if TYPE_CHECKING:  # the warm runner's zygote imports this module: it must not load pydantic
    from cortex_worker.tools.spec import Limits

SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
DEFAULT_MAX_OUTPUT_BYTES = 8 * 1024 * 1024
DRAIN_GRACE_S = 0.5
"""After the group is killed, how long to wait for pipes held by escaped processes."""

_CHUNK = 64 * 1024
_READS_PER_WAKE = 16  # then the loop looks at the deadline again (a tool that writes fast)


class SandboxError(CortexError, RuntimeError):
    """The command could not be started (not found, not executable, bad cwd)."""


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run produced."""

    returncode: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    killed_by: str | None
    """None, "timeout", "shutdown" (kill_all), "cpu_limit", "file_limit" or a signal name."""
    duration_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


# ---------------------------------------------------------------- live process groups

_live_lock = threading.RLock()  # re-entrant: kill_all may run in a signal handler
_live: dict[int, int] = {}  # pgid -> the thread that supervises it
_shutdown_killed: set[int] = set()


def live_groups() -> frozenset[int]:
    """Process group ids of the sandboxes running now."""
    with _live_lock:
        return frozenset(_live)


def kill_all() -> int:
    """SIGKILL every live sandbox process group; returns how many were signalled."""
    with _live_lock:
        groups = list(_live)
        _shutdown_killed.update(groups)
    for pgid in groups:
        _kill_group(pgid)
    return len(groups)


def kill_groups_of(thread: int) -> int:
    """SIGKILL the sandbox groups that thread `thread` supervises (its action's attempt turned
    out stale: recovery/fencing.py); returns how many were signalled."""
    with _live_lock:
        groups = [pgid for pgid, owner in _live.items() if owner == thread]
    for pgid in groups:
        _kill_group(pgid)
    return len(groups)




@cache
def install_sigterm_handler() -> None:
    """On SIGTERM, kill every live sandbox group, then chain to the previous handler.

    Call it from the main thread (Python only installs signal handlers there). Idempotent.
    The previous handler runs afterwards: a callable is called, SIG_DFL terminates the
    process as before, SIG_IGN keeps ignoring the signal.
    """
    chain_sigterm(kill_all)


def chain_sigterm(cleanup: Callable[[], object]) -> None:
    """Run `cleanup` on SIGTERM, then whatever handled SIGTERM before (SIG_DFL still ends the
    process, SIG_IGN still ignores it). Main thread only."""
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        cleanup()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL or previous is None:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


# ---------------------------------------------------------------- environment and limits


def sandbox_env(cwd: Path, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole environment of a sandboxed process (nothing from the worker's)."""
    base = {"PATH": SANDBOX_PATH, "LANG": "C.UTF-8", "HOME": str(cwd), "TMPDIR": str(cwd)}
    base.update(env or {})
    return base


def _clamp(which: int, wanted: int) -> tuple[int, int]:
    """(soft, hard) for `which`, never above the current hard limit (only root may raise it)."""
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        wanted = min(wanted, hard)
    return wanted, wanted


Rlimits = list[tuple[int, tuple[int, int]]]


def rlimits(limits: Limits) -> Rlimits:
    """(resource, (soft, hard)) for each rlimit of a sandboxed process, computed in the parent."""
    mib = 1024 * 1024
    _, cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)
    cpu = (limits.cpu_seconds, limits.cpu_seconds + 1)  # SIGXCPU first, SIGKILL one second later
    if cpu_hard != resource.RLIM_INFINITY:
        cpu = (min(cpu[0], cpu_hard), min(cpu[1], cpu_hard))
    return [
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_CPU, cpu),
        (resource.RLIMIT_AS, _clamp(resource.RLIMIT_AS, limits.memory_mb * mib)),
        (resource.RLIMIT_NPROC, _clamp(resource.RLIMIT_NPROC, limits.processes)),
        (resource.RLIMIT_FSIZE, _clamp(resource.RLIMIT_FSIZE, limits.file_mb * mib)),
    ]


def _preexec(settings: Rlimits, isolation: Isolation | None = None) -> Callable[[], None]:
    """A `preexec_fn` that sets rlimits (after the namespaces of `isolation`, if any) with
    values computed here, in the parent."""
    isolate = isolation_plan(isolation) if isolation is not None else None

    def apply() -> None:
        if isolate is not None:
            isolate()  # returns in the tool process only
        set_rlimits(settings)

    return apply


def set_rlimits(settings: Rlimits) -> None:
    """Apply `rlimits(...)` to this process (a sandboxed child, before the tool runs)."""
    for which, value in settings:
        resource.setrlimit(which, value)


# ---------------------------------------------------------------- running


def run_sandboxed(
    argv: Sequence[str],
    *,
    stdin: bytes | None = None,
    cwd: Path,
    timeout: float,
    limits: Limits | None = None,
    env: Mapping[str, str] | None = None,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    isolation: Isolation | None = None,
    finished: Callable[[bytes], bool] | None = None,
) -> SandboxResult:
    """Run `argv` (never through a shell) in `cwd` and return its exit status and output.
    `finished`: see `supervise`.

    With `isolation` it runs in namespaces of its own (cortex_worker/sandbox/isolation.py):
    its own processes only, a read-only filesystem but for the workspace, no network.

    Never raises for what the command does (non-zero exit, signal, timeout: see the result);
    raises `SandboxError` when it cannot be started.
    """
    if not argv:
        raise SandboxError("empty command: give at least the program to run")
    cwd = checked_cwd(cwd, timeout)
    full_env = sandbox_env(cwd, env)
    if limits is None:
        from cortex_worker.tools.spec import Limits
        limits = Limits()
    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=full_env,
            start_new_session=True,
            preexec_fn=_preexec(rlimits(limits), isolation),  # see the docstring
            close_fds=True,
        )
    except FileNotFoundError as exc:
        raise SandboxError(
            f"command not found: {argv[0]!r} (PATH={full_env['PATH']}); "
            "use an absolute path or install it"
        ) from exc
    except PermissionError as exc:
        raise SandboxError(f"command {argv[0]!r} is not executable: {exc}") from exc
    except OSError as exc:
        raise SandboxError(f"cannot start {argv[0]!r}: {exc}") from exc
    except subprocess.SubprocessError as exc:  # raised in preexec_fn (rlimits, user switch)
        raise SandboxError(f"cannot start {argv[0]!r} in the sandbox: {exc}") from exc
    return supervise(_Child(proc), stdin=stdin, started=started, timeout=timeout,
                     max_output_bytes=max_output_bytes, finished=finished)


def checked_cwd(cwd: Path, timeout: float) -> Path:
    """`cwd` as a Path; raises SandboxError for a missing directory or a non-positive timeout."""
    if timeout <= 0:
        raise SandboxError(f"timeout must be positive, got {timeout}")
    cwd = Path(cwd)
    if not cwd.is_dir():
        raise SandboxError(f"working directory {cwd} does not exist or is not a directory")
    return cwd


class Leader(Protocol):
    """The leader of a sandbox's process group, as `supervise` watches it."""

    pid: int
    stdin: IO[bytes] | None
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def exit_fd(self) -> int | None:
        """A new fd (the caller closes it) readable once the leader exited, still unreaped;
        None: poll `exited`."""

    def exited(self) -> bool:
        """Whether the leader exited, without reaping it."""

    def wait(self) -> int:
        """Reap the leader (its group was killed first) and return its returncode."""

    def release(self) -> None:
        """Have the leader (its group was killed first) reaped without waiting for it."""


class _Child:
    """A process started here with Popen: a pidfd or waitid(WNOWAIT) sees it exit unreaped."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.stdin, self.stdout, self.stderr = proc.stdin, proc.stdout, proc.stderr

    def exit_fd(self) -> int | None:
        try:
            return os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            return None

    def exited(self) -> bool:
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return info is not None

    def wait(self) -> int:
        return self.proc.wait()

    def release(self) -> None:
        threading.Thread(target=self.proc.wait, name="cortex-reap", daemon=True).start()


def supervise(leader: Leader, *, stdin: bytes | None, started: float, timeout: float,
              max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
              finished: Callable[[bytes], bool] | None = None) -> SandboxResult:
    """Feed and drain a started sandbox until it exits or times out, kill its group, reap it:
    the one place that does, whichever way the sandbox was started (Popen or warm runner).

    `finished(stdout)`: whether output that ended (EOF on stdout and stderr: the tool process
    is gone) is a complete answer. Then the call ends without waiting for the sandbox's
    other processes to exit one after the other: its group is killed as at any end, its
    reaping is left to `leader.release()`, and its returncode is 0."""
    with _live_lock:
        _live[leader.pid] = threading.get_ident()
    capture = _Capture(leader, stdin, started + timeout, max_output_bytes, finished)
    try:
        capture.run()
    finally:
        _kill_group(leader.pid)  # the leader is not reaped yet, so the pgid cannot be reused
        if capture.finished:
            leader.release()
            returncode = 0
        else:
            returncode = leader.wait()
        with _live_lock:
            _live.pop(leader.pid, None)
            shutdown = leader.pid in _shutdown_killed
            _shutdown_killed.discard(leader.pid)

    if (reason := setup_error(returncode, capture.err)) is not None:
        raise SandboxError(reason)
    return SandboxResult(
        returncode=returncode,
        stdout=bytes(capture.out),
        stderr=bytes(capture.err),
        timed_out=capture.timed_out,
        killed_by=_killed_by(returncode, capture.timed_out, shutdown),
        duration_s=time.monotonic() - started,
        stdout_truncated=capture.out_truncated,
        stderr_truncated=capture.err_truncated,
    )


def _killed_by(returncode: int, timed_out: bool, shutdown: bool) -> str | None:
    if timed_out:
        return "timeout"
    if shutdown and returncode < 0:
        return "shutdown"
    if returncode >= 0:
        return None
    sig = -returncode
    if sig == signal.SIGXCPU:
        return "cpu_limit"
    if sig == signal.SIGXFSZ:
        return "file_limit"
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


class _Capture:
    """One select loop: feed stdin, drain stdout/stderr, notice the leader's exit or timeout."""

    def __init__(self, proc: Leader, stdin: bytes | None, deadline: float, cap: int,
                 finished: Callable[[bytes], bool] | None = None) -> None:
        self.proc = proc
        self.is_answer = finished
        self.finished = False  # the output ended as a complete answer (see `supervise`)
        self.stdin = memoryview(stdin) if stdin is not None else None
        self.deadline = deadline
        self.cap = cap
        self.out = bytearray()
        self.err = bytearray()
        self.out_truncated = False
        self.err_truncated = False
        self.timed_out = False
        self.exited = False
        self.drain_until: float | None = None

    def run(self) -> None:
        proc = self.proc
        assert proc.stdout is not None and proc.stderr is not None
        sel = selectors.DefaultSelector()
        pidfd = self._pidfd()
        try:
            for stream, name in ((proc.stdout, "out"), (proc.stderr, "err")):
                os.set_blocking(stream.fileno(), False)  # `_handle` reads all that is there
                sel.register(stream, selectors.EVENT_READ, name)
            if proc.stdin is not None:
                if self.stdin:
                    os.set_blocking(proc.stdin.fileno(), False)
                    sel.register(proc.stdin, selectors.EVENT_WRITE, "in")
                else:
                    proc.stdin.close()
            if pidfd is not None:
                sel.register(pidfd, selectors.EVENT_READ, "exit")
            self._loop(sel, poll=pidfd is None)
        finally:
            sel.close()
            if pidfd is not None:
                os.close(pidfd)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()

    def _pidfd(self) -> int | None:
        return self.proc.exit_fd()

    def _leader_exited(self) -> bool:
        """Without reaping it: the pgid must stay reserved until the group is killed."""
        return self.proc.exited()

    def _on_exit(self) -> None:
        self.exited = True
        _kill_group(self.proc.pid)  # stragglers in the group (background jobs) die with it
        self.drain_until = time.monotonic() + DRAIN_GRACE_S

    def _loop(self, sel: selectors.BaseSelector, *, poll: bool) -> None:
        while True:
            streams = [k for k in sel.get_map().values() if k.data in ("out", "err", "in")]
            if not streams and self.exited:
                return
            if (self.is_answer is not None and not self.exited and not self.timed_out
                    and not any(k.data != "in" for k in streams) and self.is_answer(bytes(self.out))):
                self.finished = True
                return
            now = time.monotonic()
            if not self.exited and now >= self.deadline and not self.timed_out:
                self.timed_out = True
                _kill_group(self.proc.pid)
            if self.drain_until is not None and now >= self.drain_until:
                return
            wait = (self.drain_until or self.deadline) - now
            if self.timed_out and not self.exited:
                wait = 0.05  # killed: the exit is imminent
            if poll:
                wait = min(wait, 0.05)
            for key, _ in sel.select(max(wait, 0.0)):
                self._handle(sel, key)
            if poll and not self.exited and self._leader_exited():
                self._on_exit()

    def _handle(self, sel: selectors.BaseSelector, key: selectors.SelectorKey) -> None:
        if key.data == "exit":
            sel.unregister(key.fileobj)
            self._on_exit()
        elif key.data == "in":
            self._write_stdin(sel, key)
        else:  # what is there, and its end if that came with it: one wake, not two
            for _ in range(_READS_PER_WAKE):
                try:
                    data = os.read(key.fd, _CHUNK)
                except BlockingIOError:
                    return
                if not data:
                    sel.unregister(key.fileobj)
                    return
                self._keep(key.data, data)

    def _keep(self, stream: str, data: bytes) -> None:
        buf = self.out if stream == "out" else self.err
        room = self.cap - len(buf)
        if len(data) > room:
            if stream == "out":
                self.out_truncated = True
            else:
                self.err_truncated = True
        if room > 0:
            buf += data[:room]

    def _write_stdin(self, sel: selectors.BaseSelector, key: selectors.SelectorKey) -> None:
        assert self.stdin is not None and self.proc.stdin is not None
        try:
            written = os.write(key.fd, self.stdin[:_CHUNK])
        except BlockingIOError:
            return
        except BrokenPipeError:
            written = len(self.stdin)  # the process stopped reading: drop the rest
        self.stdin = self.stdin[written:]
        if not self.stdin:
            sel.unregister(key.fileobj)
            self.proc.stdin.close()
