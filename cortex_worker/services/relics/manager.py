"""User-defined (`runtime: http`) relics in the relic pool's worker process: a service pool
(`cortex_worker.services.pool`) whose instances answer HTTP on a port.

`RelicManager` keeps at most one running instance of each relic per worker process, with the
pool's lifecycle (started on first use, health-checked before use, restarted, stopped when
idle, all stopped at worker shutdown, orphans of a dead worker killed). What a relic adds:

- its process is started with a minimal environment (PATH, LANG, HOME = TMPDIR = its home
  directory, PORT, the manifest's `env`) and a free port chosen by Cortex (`{port}` in the
  command, `PORT` in the environment), in the directory of the manifest that declared it; it
  is ready when `GET <health.path>` answers 2xx, else `ToolError` after `startup_timeout_s`
  with the tail of its log;
- a request that cannot connect at all restarts it once, transparently (nothing was sent, so
  it is safe).
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from cortex_worker.services.pool import Instance, ServicePool
from cortex_worker.services.relics.spec import OperationSpec, RelicSpec, fill
from cortex_worker.tools.errors import ToolError, ToolTimeout

log = logging.getLogger(__name__)

RELIC_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass
class RelicInstance(Instance[RelicSpec]):
    """One running relic process and the port it answers on."""

    port: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RelicManager(ServicePool[RelicSpec, RelicInstance]):
    """Running instances of http relics, by name; thread-safe."""

    kind = "relic"

    def __init__(self, root: Path, *, python: str | None = None) -> None:
        self.python = python or sys.executable
        self._client = httpx.Client(trust_env=False)
        super().__init__(root)

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

    # ------------------------------------------------------------ the pool's steps

    def _health(self, inst: RelicInstance) -> str | None:
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

    def _start(self, spec: RelicSpec) -> RelicInstance:
        """Start an instance and wait until it is healthy (caller holds the relic's lock)."""
        port = free_port()
        argv = self._command(spec, port)
        home, log_path = self._directories(spec.name)
        cwd = spec.base_dir or home
        env = {"PATH": RELIC_PATH, "LANG": "C.UTF-8", "HOME": str(home), "TMPDIR": str(home),
               "PORT": str(port), **spec.env}
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
        inst = RelicInstance(spec, proc, log_path, offset, self._pid_file(spec.name), port=port)
        self._record(inst, port=port)
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
        log.info("relic %s started (pid %s, port %s)", spec.name, proc.pid, port)
        return inst

    # ------------------------------------------------------------ HTTP

    def _request(self, inst: RelicInstance, operation: str, op: OperationSpec,
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
