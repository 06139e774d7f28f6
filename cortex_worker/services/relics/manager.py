"""The lifecycle of user-defined (`runtime: http`) relics in the relic pool's worker process.

`RelicManager` keeps at most one running instance of each relic per worker process:

- **started on first use**: `Popen` in its own session (process group), with a minimal
  environment (PATH, LANG, HOME = TMPDIR = its home directory, PORT, the manifest's `env`)
  and a free port chosen by Cortex (`{port}` in the command, `PORT` in the environment),
  in the directory of the manifest that declared it; ready when `GET <health.path>` answers
  2xx, else `ToolError` after `startup_timeout_s` with the tail of its log;
- **health-checked before use** when the last good check is older than `health.interval_s`;
- **restarted** when its process has exited or its health check fails, and once more
  (transparently) when a request cannot connect at all (nothing was sent, so it is safe);
- **stopped when idle** for `idle_timeout_s` by a reaper thread (never during a call);
- **all stopped** at worker shutdown (`install_shutdown_hooks`: atexit and Celery's
  `worker_shutdown` / `worker_process_shutdown` signals).

Stopping sends SIGTERM to the whole group, then SIGKILL after `STOP_GRACE_S`. Each running
instance is also written to `<root>/pids/<name>.<worker pid>.json`: a worker that died by
SIGKILL cannot stop its relics, so the next manager started with the same root kills the
instances whose owner is gone (`reap_orphans`).

One instance per *process*: a prefork pool would give every child its own. The relic pool
runs with threads (`cortex worker --pool relic`), so one worker = one instance per relic.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from cortex_worker.services.relics.spec import OperationSpec, RelicSpec, fill
from cortex_worker.tools.errors import ToolError, ToolTimeout

log = logging.getLogger(__name__)

RELIC_PATH = "/usr/local/bin:/usr/bin:/bin"
STOP_GRACE_S = 3.0
LOG_TAIL_BYTES = 2000
MAX_REAP_INTERVAL_S = 5.0
MIN_REAP_INTERVAL_S = 0.05


@dataclass
class Instance:
    """One running relic process."""

    spec: RelicSpec
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    log_offset: int
    pid_file: Path
    started_at: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    last_healthy: float = field(default_factory=time.monotonic)
    in_flight: int = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def exited(self) -> int | None:
        return self.proc.poll()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_time(pid: int) -> str | None:
    """The kernel's start time of `pid`, to tell a reused pid apart (Linux; None elsewhere)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[19]


def unreaped(pid: int) -> bool:
    """Whether `pid` is still our unreaped child, so its group id is still its own. Once it
    is reaped (by `poll`, or an asyncio child watcher), the pid may be any process's."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class RelicManager:
    """Running instances of http relics, by name; thread-safe."""

    def __init__(self, root: Path, *, python: str | None = None) -> None:
        self.root = Path(root)
        self.python = python or sys.executable
        self._instances: dict[str, Instance] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop_reaper = threading.Event()
        self._reaper: threading.Thread | None = None
        self._client = httpx.Client(trust_env=False)
        self.reap_orphans()

    # ------------------------------------------------------------ public

    def call(self, spec: RelicSpec, operation: str, params: Mapping[str, Any],
             timeout: float) -> Any:
        """Run one operation of an http relic (starting it if needed); its JSON answer."""
        op = spec.operations[operation]
        deadline = time.monotonic() + timeout
        for attempt in (1, 2):
            inst = self.acquire(spec)
            try:
                return self._request(inst, operation, op, params, deadline)
            except httpx.ConnectError as exc:  # nothing was sent: safe to restart and retry
                if attempt == 2:
                    raise ToolError(f"relic {spec.name!r} does not accept connections on port "
                                    f"{inst.port}: {exc}") from exc
                log.warning("relic %s (pid %s) refused a connection; restarting it",
                            spec.name, inst.pid)
                inst.last_healthy = float("-inf")  # the next acquire checks (and restarts)
            finally:
                self.release(inst)
        raise AssertionError("unreachable")

    def acquire(self, spec: RelicSpec) -> Instance:
        """The relic's running, healthy instance (started or restarted as needed), marked
        busy until `release`. ToolError when it cannot be started."""
        with self._lock_for(spec.name):
            inst = self._instances.get(spec.name)
            if inst is not None:
                reason = self._unfit(inst)
                if reason is not None:
                    log.warning("relic %s (pid %s) %s; restarting it", spec.name, inst.pid,
                                reason)
                    self._stop(inst, f"restart: {reason}")
                    inst = None
            if inst is None:
                inst = self._start(spec)
            inst.in_flight += 1
            inst.last_used = time.monotonic()
            return inst

    def release(self, inst: Instance) -> None:
        with self._lock:
            inst.in_flight -= 1
            inst.last_used = time.monotonic()

    def running(self) -> dict[str, int]:
        """name → pid of the instances running now."""
        with self._lock:
            return {name: inst.pid for name, inst in self._instances.items()}

    def instance(self, name: str) -> Instance | None:
        with self._lock:
            return self._instances.get(name)

    def stop(self, name: str) -> bool:
        """Stop the relic's instance now; False if none runs."""
        with self._lock_for(name):
            inst = self._instances.get(name)
            if inst is None:
                return False
            self._stop(inst, "stopped on request")
            return True

    def stop_all(self) -> None:
        """Stop every instance and the reaper (worker shutdown). The manager stays usable."""
        self._stop_reaper.set()
        self._wake.set()
        reaper = self._reaper
        if reaper is not None and reaper is not threading.current_thread():
            reaper.join(timeout=STOP_GRACE_S + 1)
        with self._lock:
            instances = list(self._instances.values())
        for inst in instances:
            self._stop(inst, "worker shutdown")
        self._reaper = None
        self._stop_reaper.clear()

    def reap_idle(self, now: float | None = None) -> list[str]:
        """Stop the instances idle past their `idle_timeout_s` (and forget dead ones)."""
        now = time.monotonic() if now is None else now
        stopped = []
        with self._lock:
            candidates = list(self._instances.values())
        for inst in candidates:
            lock = self._lock_for(inst.spec.name)
            if not lock.acquire(blocking=False):
                continue  # starting or restarting: not idle
            try:
                if self._instances.get(inst.spec.name) is not inst or inst.in_flight:
                    continue
                if now - inst.last_used >= inst.spec.idle_timeout_s:
                    self._stop(inst, f"idle for {inst.spec.idle_timeout_s:g}s")
                    stopped.append(inst.spec.name)
                elif inst.exited() is not None:
                    self._stop(inst, f"exited with code {inst.exited()}")
            finally:
                lock.release()
        return stopped

    def reap_orphans(self) -> int:
        """Kill instances recorded by worker processes that are gone; returns how many."""
        killed = 0
        for path in (self.root / "pids").glob("*.json"):
            try:
                record = json.loads(path.read_text())
                owner, owner_start = int(record["owner"]), record.get("owner_start")
                pid, start = int(record["pid"]), record.get("start")
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if _start_time(owner) is not None and _start_time(owner) == owner_start:
                continue  # its worker lives
            if start is not None and _start_time(pid) == start:
                log.warning("killing relic %s (pid %s) left by dead worker %s",
                            record.get("name"), pid, owner)
                kill_group(pid, signal.SIGKILL)
                killed += 1
            with contextlib.suppress(OSError):
                path.unlink()
        return killed

    # ------------------------------------------------------------ lifecycle

    def _lock_for(self, name: str) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault(name, threading.Lock())

    def _unfit(self, inst: Instance) -> str | None:
        """Why the instance must be restarted before use, or None."""
        code = inst.exited()
        if code is not None:
            return f"exited with code {code}"
        if time.monotonic() - inst.last_healthy >= inst.spec.health.interval_s:
            problem = self._health(inst)
            if problem is not None:
                return f"failed its health check ({problem})"
            inst.last_healthy = time.monotonic()
        return None

    def _health(self, inst: Instance) -> str | None:
        """None if `GET <health.path>` answers 2xx in time, else what went wrong."""
        health = inst.spec.health
        try:
            response = self._client.get(inst.base_url + health.path, timeout=health.timeout_s)
        except httpx.TimeoutException:
            return f"GET {health.path} did not answer within {health.timeout_s:g}s"
        except httpx.HTTPError as exc:
            return f"GET {health.path}: {type(exc).__name__}: {exc}"
        if not response.is_success:
            return f"GET {health.path} answered HTTP {response.status_code}"
        return None

    def _command(self, spec: RelicSpec, port: int) -> list[str]:
        base = spec.base_dir or Path.cwd()
        values = {"port": str(port), "python": self.python, "manifest_dir": str(base)}
        return [fill(arg, values) for arg in spec.command or ()]

    def _start(self, spec: RelicSpec) -> Instance:
        """Start an instance and wait until it is healthy (caller holds the relic's lock)."""
        port = free_port()
        argv = self._command(spec, port)
        home = self.root / "home" / spec.name
        logs = self.root / "logs"
        for directory in (home, logs, self.root / "pids"):
            directory.mkdir(parents=True, exist_ok=True)
        cwd = spec.base_dir or home
        env = {"PATH": RELIC_PATH, "LANG": "C.UTF-8", "HOME": str(home), "TMPDIR": str(home),
               "PORT": str(port), **spec.env}
        log_path = logs / f"{spec.name}.log"
        with open(log_path, "ab") as out:
            out.write(f"--- cortex: starting relic {spec.name} on port {port}: "
                      f"{argv}\n".encode())
            out.flush()
            offset = out.tell()
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                        start_new_session=True, close_fds=True)
            except FileNotFoundError as exc:
                raise ToolError(f"relic {spec.name!r} cannot start: command not found: "
                                f"{argv[0]!r} (PATH={RELIC_PATH}, cwd={cwd}); use an absolute "
                                "path, {python}, or install it") from exc
            except OSError as exc:
                raise ToolError(f"relic {spec.name!r} cannot start {argv[0]!r}: {exc}") from exc
        pid_file = self.root / "pids" / f"{spec.name}.{os.getpid()}.json"
        inst = Instance(spec, proc, port, log_path, offset, pid_file)
        self._record(inst)
        deadline = time.monotonic() + spec.startup_timeout_s
        problem: str | None = None
        while True:
            code = proc.poll()
            if code is not None:
                self._stop(inst, "failed to start")
                raise ToolError(f"relic {spec.name!r} exited with code {code} while starting "
                                f"(command {argv}){self._tail(inst)}")
            problem = self._health(inst)
            if problem is None:
                break
            if time.monotonic() >= deadline:
                self._stop(inst, "failed to start")
                raise ToolError(f"relic {spec.name!r} did not become healthy within "
                                f"{spec.startup_timeout_s:g}s (startup_timeout_s) on port {port}: "
                                f"{problem}{self._tail(inst)}")
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        inst.last_healthy = inst.last_used = time.monotonic()
        with self._lock:
            self._instances[spec.name] = inst
        log.info("relic %s started (pid %s, port %s)", spec.name, proc.pid, port)
        self._ensure_reaper()
        return inst

    def _record(self, inst: Instance) -> None:
        record = {"name": inst.spec.name, "pid": inst.pid, "start": _start_time(inst.pid),
                  "port": inst.port, "owner": os.getpid(), "owner_start": _start_time(os.getpid())}
        with contextlib.suppress(OSError):
            inst.pid_file.write_text(json.dumps(record))

    def _tail(self, inst: Instance) -> str:
        try:
            with open(inst.log_path, "rb") as f:
                f.seek(max(inst.log_offset, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
                text = f.read().decode(errors="replace").strip()
        except OSError:
            return ""
        return f"; its output ends with:\n{text}" if text else "; it wrote no output"

    def _stop(self, inst: Instance, reason: str) -> None:
        """SIGTERM the group, SIGKILL it after the grace period, reap the leader."""
        with self._lock:
            if self._instances.get(inst.spec.name) is inst:
                del self._instances[inst.spec.name]
        proc = inst.proc
        if proc.returncode is None:
            kill_group(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            while time.monotonic() < deadline and not self._leader_exited(proc.pid):
                time.sleep(0.02)
        if proc.returncode is None and unreaped(proc.pid):
            kill_group(proc.pid, signal.SIGKILL)  # stragglers; the leader is not reaped yet
        # (once `poll` has reaped the leader, its pid, and so the group id, may be any
        # process's: signalling it killed another stack's worker)
        with contextlib.suppress(Exception):
            proc.wait(timeout=STOP_GRACE_S)
        with contextlib.suppress(OSError):
            inst.pid_file.unlink()
        log.info("relic %s (pid %s) stopped: %s", inst.spec.name, proc.pid, reason)

    @staticmethod
    def _leader_exited(pid: int) -> bool:
        """Without reaping it (WNOWAIT): the pgid stays reserved until the group is killed."""
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return info is not None

    # ------------------------------------------------------------ reaper

    def _ensure_reaper(self) -> None:
        self._wake.set()
        if self._reaper is not None and self._reaper.is_alive():
            return
        self._reaper = threading.Thread(target=self._reap_loop, name="relic-reaper",
                                        daemon=True)
        self._reaper.start()

    def _reap_loop(self) -> None:
        while not self._stop_reaper.is_set():
            with self._lock:
                timeouts = [i.spec.idle_timeout_s for i in self._instances.values()]
            interval = min([MAX_REAP_INTERVAL_S, *(t / 4 for t in timeouts)])
            self._wake.wait(max(MIN_REAP_INTERVAL_S, interval))
            self._wake.clear()
            if self._stop_reaper.is_set():
                return
            try:
                self.reap_idle()
            except Exception:  # the reaper must survive anything
                log.exception("relic reaper failed")

    # ------------------------------------------------------------ HTTP

    def _request(self, inst: Instance, operation: str, op: OperationSpec,
                 params: Mapping[str, Any], deadline: float) -> Any:
        spec = inst.spec
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ToolTimeout(f"relic {spec.name!r}: no time left for operation {operation!r} "
                              "after starting it")
        properties = op.parameters.get("properties") or {}
        in_path = op.path_parameters
        values = {}
        for name in in_path:
            value = params[name] if name in params else properties[name]["default"]
            values[name] = quote(value if isinstance(value, str) else json.dumps(value), safe="")
        path = fill(op.path or "/", values)
        rest = {k: v for k, v in params.items() if k not in in_path}
        kwargs: dict[str, Any] = {}
        if op.method in ("POST", "PUT"):
            kwargs["json"] = rest
        elif rest:
            kwargs["params"] = {k: v if isinstance(v, str) else json.dumps(v)
                                for k, v in rest.items()}
        try:
            response = self._client.request(op.method, inst.base_url + path, timeout=remaining,
                                            **kwargs)
        except httpx.ConnectError:
            raise
        except httpx.TimeoutException as exc:
            raise ToolTimeout(f"relic {spec.name!r} operation {operation!r} did not answer "
                              f"within {remaining:.3g}s") from exc
        except httpx.HTTPError as exc:
            raise ToolError(f"relic {spec.name!r} operation {operation!r}: {op.method} {path} "
                            f"failed: {type(exc).__name__}: {exc} (the relic may have crashed; "
                            "it is restarted on next use)") from exc
        value = _body(response)
        if not response.is_success:
            raise ToolError(f"relic {spec.name!r} operation {operation!r} failed: HTTP "
                            f"{response.status_code}: {_message(value)}")
        return value


def _body(response: httpx.Response) -> Any:
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        return response.text


def _message(value: Any) -> str:
    if isinstance(value, dict):
        for key in ("error", "message", "detail"):
            if key in value:
                inner = value[key]
                return inner if isinstance(inner, str) else json.dumps(inner)
    text = value if isinstance(value, str) else json.dumps(value)
    return text[:500] + ("…" if len(text) > 500 else "") if text else "(empty body)"


# ---------------------------------------------------------------- the process's manager

_manager: RelicManager | None = None
_manager_lock = threading.Lock()


def get_manager(root: Path) -> RelicManager:
    """This process's manager (created on first use, with `root` for its files)."""
    global _manager
    with _manager_lock:
        if _manager is None:
            _manager = RelicManager(root)
        return _manager


def shutdown(**_: Any) -> None:
    """Stop every relic this process started (worker shutdown, interpreter exit)."""
    manager = _manager
    if manager is not None:
        manager.stop_all()


_hooks_installed = False


def install_shutdown_hooks() -> None:
    """Stop the relics at exit and on Celery's worker (process) shutdown. Idempotent."""
    global _hooks_installed
    if _hooks_installed:
        return
    from celery.signals import worker_process_shutdown, worker_shutdown

    atexit.register(shutdown)
    worker_shutdown.connect(shutdown, weak=False)
    worker_process_shutdown.connect(shutdown, weak=False)
    _hooks_installed = True
