"""One generic pool of long-lived service processes per worker process: relics and MCP servers.

A `ServicePool` keeps at most one running instance of each service, by name; thread-safe:

- **started on first use** (`acquire`): the subclass's `_start` launches it (own session, so
  its own process group) with its output in `<root>/logs/<name>.log`, and returns once it is
  ready, or raises `ToolError` with the tail of that log;
- **health-checked before use** when the last good check is older than `health.interval_s`;
- **restarted** when its process has exited or it fails its check (`_unfit`);
- **stopped when idle** for `idle_timeout_s` by a reaper thread (never while in use);
- **all stopped** at worker shutdown (`service_pools`, stopped by `cortex_worker.worker.steps`)
  and at interpreter exit.

Stopping sends SIGTERM to the whole group, then SIGKILL after `STOP_GRACE_S`. Each running
process is also written to `<root>/pids/<name>.<worker pid>.json`: a worker that died by
SIGKILL cannot stop its services, so the next pool started with the same root kills the
instances whose owner is gone (`reap_orphans`).

One instance per *process*: a prefork pool would give every child its own. The relic pool runs
with threads (`cortex worker --pool relic`), so one worker = one instance per service.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar

log = logging.getLogger(__name__)

STOP_GRACE_S = 3.0
LOG_TAIL_BYTES = 2000
MAX_REAP_INTERVAL_S = 5.0
MIN_REAP_INTERVAL_S = 0.05


class Health(Protocol):
    """How often and how long a service's health is checked."""

    @property
    def interval_s(self) -> float: ...

    @property
    def timeout_s(self) -> float: ...


class ServiceSpec(Protocol):
    """What the pool reads of a service's manifest."""

    @property
    def name(self) -> str: ...

    @property
    def idle_timeout_s(self) -> float: ...

    @property
    def health(self) -> Health: ...


SpecT = TypeVar("SpecT", bound=ServiceSpec)


@dataclass
class Instance(Generic[SpecT]):
    """One running service: its process here (None: a remote service, nothing runs here)."""

    spec: SpecT
    proc: subprocess.Popen[bytes] | None
    log_path: Path
    log_offset: int
    pid_file: Path
    started_at: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    last_healthy: float = field(default_factory=time.monotonic)
    in_flight: int = 0

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def exited(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None


InstanceT = TypeVar("InstanceT", bound=Instance[Any])


def start_time(pid: int) -> str | None:
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


def _leader_exited(pid: int) -> bool:
    """Without reaping it (WNOWAIT): the pgid stays reserved until the group is killed."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the group, SIGKILL it after the grace period, reap the leader."""
    if proc.returncode is None:
        kill_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and not _leader_exited(proc.pid):
            time.sleep(0.02)
    if proc.returncode is None and unreaped(proc.pid):
        kill_group(proc.pid, signal.SIGKILL)  # stragglers; the leader is not reaped yet
    # (once `poll` has reaped the leader, its pid, and so the group id, may be any
    # process's: signalling it killed another stack's worker)
    with contextlib.suppress(Exception):
        proc.wait(timeout=STOP_GRACE_S)


class ServicePool(ABC, Generic[SpecT, InstanceT]):
    """Running instances of one kind of service, by name; thread-safe. A subclass says how
    an instance starts (`_start`) and how its health is checked (`_health`)."""

    kind: ClassVar[str]
    """What the services are called in logs: "relic", "MCP server"."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._instances: dict[str, InstanceT] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop_reaper = threading.Event()
        self._reaper: threading.Thread | None = None
        self.reap_orphans()

    # ------------------------------------------------------------ what a kind says

    @abstractmethod
    def _start(self, spec: SpecT) -> InstanceT:
        """Start an instance and return it once it is ready; ToolError if it cannot start
        (the caller holds the service's lock, and registers the instance)."""

    @abstractmethod
    def _health(self, inst: InstanceT) -> str | None:
        """None if the instance answers its health check in time, else what went wrong."""

    def _close(self, inst: InstanceT) -> None:
        """What stopping an instance does before its process group is stopped."""

    # ------------------------------------------------------------ public

    def acquire(self, spec: SpecT) -> InstanceT:
        """The service's running, healthy instance (started or restarted as needed), marked
        busy until `release`. ToolError when it cannot be started."""
        with self._lock_for(spec.name):
            inst = self._instances.get(spec.name)
            if inst is not None:
                reason = self._unfit(inst)
                if reason is not None:
                    log.warning("%s %s (pid %s) %s; restarting it", self.kind, spec.name,
                                inst.pid, reason)
                    self._stop(inst, f"restart: {reason}")
                    inst = None
            if inst is None:
                inst = self._start(spec)
                inst.last_healthy = inst.last_used = time.monotonic()
                with self._lock:
                    self._instances[spec.name] = inst
                self._ensure_reaper()
            inst.in_flight += 1
            inst.last_used = time.monotonic()
            return inst

    def release(self, inst: InstanceT) -> None:
        with self._lock:
            inst.in_flight -= 1
            inst.last_used = time.monotonic()

    def running(self) -> dict[str, int]:
        """name → pid of the instances running now."""
        with self._lock:
            return {name: inst.pid for name, inst in self._instances.items()}

    def instance(self, name: str) -> InstanceT | None:
        with self._lock:
            return self._instances.get(name)

    def stop(self, name: str) -> bool:
        """Stop the service's instance now; False if none runs."""
        with self._lock_for(name):
            inst = self._instances.get(name)
            if inst is None:
                return False
            self._stop(inst, "stopped on request")
            return True

    def stop_all(self) -> None:
        """Stop every instance and the reaper (worker shutdown). The pool stays usable."""
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
            if start_time(owner) is not None and start_time(owner) == owner_start:
                continue  # its worker lives
            if start is not None and start_time(pid) == start:
                log.warning("killing %s %s (pid %s) left by dead worker %s", self.kind,
                            record.get("name"), pid, owner)
                kill_group(pid, signal.SIGKILL)
                killed += 1
            with contextlib.suppress(OSError):
                path.unlink()
        return killed

    # ------------------------------------------------------------ for the kinds' `_start`

    def _directories(self, name: str) -> tuple[Path, Path]:
        """The service's home and log file (their directories made, and the pid records')."""
        home = self.root / "home" / name
        logs = self.root / "logs"
        for directory in (home, logs, self.root / "pids"):
            directory.mkdir(parents=True, exist_ok=True)
        return home, logs / f"{name}.log"

    def _pid_file(self, name: str) -> Path:
        return self.root / "pids" / f"{name}.{os.getpid()}.json"

    def _record(self, inst: InstanceT, **extra: Any) -> None:
        """Write the pid record of an instance whose process runs here (`reap_orphans`)."""
        record = {"name": inst.spec.name, "pid": inst.pid, "start": start_time(inst.pid),
                  **extra, "owner": os.getpid(), "owner_start": start_time(os.getpid())}
        with contextlib.suppress(OSError):
            inst.pid_file.write_text(json.dumps(record))

    def _tail(self, inst: InstanceT) -> str:
        try:
            with open(inst.log_path, "rb") as f:
                f.seek(max(inst.log_offset, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
                text = f.read().decode(errors="replace").strip()
        except OSError:
            return ""
        return f"; its output ends with:\n{text}" if text else "; it wrote no output"

    # ------------------------------------------------------------ lifecycle

    def _lock_for(self, name: str) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault(name, threading.Lock())

    def _unfit(self, inst: InstanceT) -> str | None:
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

    def _stop(self, inst: InstanceT, reason: str) -> None:
        """`_close` the instance, forget it, then stop its process group (if it runs here)."""
        self._close(inst)
        with self._lock:
            if self._instances.get(inst.spec.name) is inst:
                del self._instances[inst.spec.name]
        if inst.proc is None:
            log.info("%s %s disconnected: %s", self.kind, inst.spec.name, reason)
            return
        stop_group(inst.proc)
        with contextlib.suppress(OSError):
            inst.pid_file.unlink()
        log.info("%s %s (pid %s) stopped: %s", self.kind, inst.spec.name, inst.pid, reason)

    # ------------------------------------------------------------ reaper

    def _ensure_reaper(self) -> None:
        self._wake.set()
        if self._reaper is not None and self._reaper.is_alive():
            return
        self._reaper = threading.Thread(target=self._reap_loop, name=f"{self.kind}-reaper",
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
                log.exception("%s reaper failed", self.kind)


PoolT = TypeVar("PoolT", bound=ServicePool[Any, Any])


class ServicePools:
    """This process's pools, one per kind, each made on first use."""

    def __init__(self) -> None:
        self._pools: dict[type[ServicePool[Any, Any]], ServicePool[Any, Any]] = {}
        self._lock = threading.Lock()

    def get(self, kind: type[PoolT], root: Path) -> PoolT:
        """The pool of `kind` (made on first use, with `root` for its files)."""
        with self._lock:
            pool = self._pools.get(kind)
            if pool is None:
                pool = self._pools[kind] = kind(root)
        assert isinstance(pool, kind)
        return pool

    def stop_all(self) -> None:
        """Stop every service of every pool (worker shutdown, interpreter exit)."""
        with self._lock:
            pools = list(self._pools.values())
        for pool in pools:
            pool.stop_all()


@cache
def service_pools() -> ServicePools:
    """This process's pools; their services are stopped at interpreter exit too (a process
    that is not a Celery worker, or one that exits without its shutdown signals)."""
    pools = ServicePools()
    atexit.register(pools.stop_all)
    return pools
