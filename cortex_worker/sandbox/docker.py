"""Run a docker tool in a throwaway container: the sandbox of the `docker` pool.

Every container gets, unless its manifest says otherwise where it may (see docs/docker.md):

- no network (`network_mode="none"`: its own namespace with only a loopback); a manifest may
  ask for `network: host`, nothing else: no bridge network is ever created or joined;
- a read-only root filesystem, a private tmpfs on /tmp (`limits.file_mb`), and the job's
  workspace bind-mounted read-write at /workspace (the working directory by default);
- cgroup limits: memory = `limits.memory_mb` (no swap on top), `cpus` CPUs (default 1),
  pids = `limits.processes`; rlimits: CPU time `limits.cpu_seconds`, file size
  `limits.file_mb`, no core dumps;
- `cap_drop=["ALL"]`, `no-new-privileges`, the uid:gid that owns the workspace (the user
  python and shell tools run as; files it writes there stay theirs), no TTY;
- an environment made of the image's, the manifest's `env` and the action's attempt
  (`CORTEX_JOB_ID`, `CORTEX_ACTION_ID`, `CORTEX_ATTEMPT`, `CORTEX_IDEMPOTENCY_KEY`) only:
  nothing of the worker's;
- labels `cortex.job_id`, `cortex.action_id` and `cortex.tool` (`docker ps --filter
  label=cortex.job_id=<job>` finds a job's containers);
- the "none" log driver: its output is read from an attach stream (capped per stream), never
  written to the daemon's disk.

Images are never pulled: a missing image fails the action with a ToolError saying so. On
timeout the container is killed and `ToolTimeout` raised; whatever happens the container is
removed (`remove(force=True)`). The first call in a process's main thread chains a SIGTERM
handler that removes the containers of running calls (a revoked task's process gets SIGTERM),
then calls the previous handler. A worker killed with SIGKILL cannot clean up: the next
docker call of any worker on the same host removes the containers whose `cortex.worker` label
names a process that no longer runs (and every minute after that).

The daemon is `settings.docker_host` (`CORTEX_DOCKER_HOST`), else the SDK's environment
(`DOCKER_HOST`, default unix:///var/run/docker.sock). It must run on the worker's machine:
the workspace is bind-mounted by path.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import docker
import requests
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.models.containers import Container
from docker.types import LogConfig, Ulimit
from docker.utils.socket import frames_iter

from cortex_worker.recovery.owners import dead_here, owner
from cortex_worker.sandbox.process import DEFAULT_MAX_OUTPUT_BYTES, chain_sigterm
from cortex_worker.settings import Settings
from cortex_worker.tools.context import ToolContext
from cortex_worker.tools.errors import ToolError, ToolTimeout
from cortex_worker.tools.spec import ToolSpec

__all__ = [
    "LABEL_ACTION",
    "LABEL_JOB",
    "LABEL_TOOL",
    "LABEL_WORKER",
    "WORKSPACE",
    "ContainerResult",
    "connect",
    "container_config",
    "kill_all",
    "run_container",
]

log = logging.getLogger(__name__)

WORKSPACE = "/workspace"
"""Where the job's workspace is mounted in the container (and the default working directory)."""
DEFAULT_CPUS = 1.0
LABEL_JOB = "cortex.job_id"
LABEL_ACTION = "cortex.action_id"
LABEL_TOOL = "cortex.tool"
LABEL_WORKER = "cortex.worker"
"""The worker process that started the container, `host:pid` (see cortex_worker/recovery/owners.py)."""
REAP_EVERY_S = 60.0
"""How often a worker removes the containers of dead workers of its host (and at its first call)."""
API_TIMEOUT_S = 30.0
"""Timeout of each Docker API call (not of the container's run)."""
EXIT_GRACE_S = 10.0
"""After a kill, how long to wait for the container to be reported as exited."""
DRAIN_GRACE_S = 2.0
"""After the container exited, how long to wait for the rest of its output."""
_CHUNK = 64 * 1024


@dataclass(frozen=True)
class ContainerResult:
    """What a container run produced."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    duration_s: float
    oom_killed: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def why(self, spec: ToolSpec) -> str:
        """Why the process ended, if a limit ended it ("" otherwise), for error messages."""
        if self.oom_killed:
            return f" (out of memory: the limit is {spec.limits.memory_mb} MiB)"
        if self.exit_code == 128 + signal.SIGXCPU:
            return f" (CPU time limit of {spec.limits.cpu_seconds}s)"
        if self.exit_code == 128 + signal.SIGXFSZ:
            return f" (file size limit of {spec.limits.file_mb} MiB)"
        if self.exit_code == 128 + signal.SIGKILL:
            return " (killed)"
        return ""


OOM_EVENT_WAIT_S = 2.0
"""How long a container killed by SIGKILL is looked at again for Docker's OOM flag: the daemon
sets it from containerd's OOM event, which can arrive after the exit (a busy machine showed a
memory-limited container's `137` with `OOMKilled` still false)."""


def _oom_killed(container: Any, status: int, timed_out: bool) -> bool:
    """Whether the kernel's OOM killer ended the container (Docker's `State.OOMKilled`)."""
    deadline = time.monotonic() + (OOM_EVENT_WAIT_S if status == 128 + signal.SIGKILL
                                   and not timed_out else 0.0)
    while True:
        with contextlib.suppress(DockerException, requests.RequestException):
            container.reload()
            if container.attrs.get("State", {}).get("OOMKilled"):
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


# ---------------------------------------------------------------- the daemon


def _where(settings: Settings) -> str:
    if settings.docker_host:
        return settings.docker_host
    if os.environ.get("DOCKER_HOST"):
        return f"{os.environ['DOCKER_HOST']} (DOCKER_HOST)"
    return "unix:///var/run/docker.sock (the default)"


def _reason(exc: BaseException, limit: int = 300) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "…"


def connect(settings: Settings) -> docker.DockerClient:
    """A client of the configured daemon, API version negotiated; ToolError if unreachable."""
    try:
        if settings.docker_host:
            return docker.DockerClient(base_url=settings.docker_host, timeout=API_TIMEOUT_S)
        return docker.from_env(timeout=API_TIMEOUT_S)
    except DockerException as exc:
        raise ToolError(
            f"cannot reach the Docker daemon at {_where(settings)}: {_reason(exc)}; start "
            "dockerd, or point CORTEX_DOCKER_HOST (or DOCKER_HOST) of the docker pool's workers "
            "at a running daemon"
        ) from None


def _lost(settings: Settings, exc: BaseException, doing: str) -> ToolError:
    return ToolError(f"Docker daemon error while {doing} (at {_where(settings)}): {_reason(exc)}")


# ---------------------------------------------------------------- containers of running calls

_live_lock = threading.RLock()  # re-entrant: kill_all runs in a signal handler
_live: dict[str, tuple[Settings, int]] = {}  # container -> its settings, the calling thread


def kill_all() -> int:
    """Remove (force) every container started by a call still running in this process."""
    return _remove(lambda thread: True)


def kill_containers_of(thread: int) -> int:
    """Remove (force) the containers of the calls thread `thread` runs (its action's attempt
    turned out stale: recovery/fencing.py)."""
    return _remove(lambda owner: owner == thread)


def _remove(which: Callable[[int], bool]) -> int:
    with _live_lock:
        live = {cid: settings for cid, (settings, thread) in _live.items() if which(thread)}
    removed = 0
    for container_id, settings in live.items():
        with contextlib.suppress(Exception):  # best effort: the process is going down
            client = connect(settings)
            try:
                client.api.remove_container(container_id, v=True, force=True)
                removed += 1
            finally:
                client.close()
    return removed


def _install_sigterm_handler() -> None:
    """Chain a SIGTERM handler that removes live containers (main thread only; once)."""
    if threading.current_thread() is threading.main_thread():
        _chain_kill_all()


@cache
def _chain_kill_all() -> None:
    chain_sigterm(kill_all)


@contextlib.contextmanager
def _registered(container_id: str, settings: Settings) -> Iterator[None]:
    with _live_lock:
        _live[container_id] = (settings, threading.get_ident())
    try:
        yield
    finally:
        with _live_lock:
            _live.pop(container_id, None)


_last_reap = [float("-inf")]


def _reap_orphans(client: docker.DockerClient) -> None:
    """Remove the containers that a worker of this host started and did not live to remove
    (killed with SIGKILL). At most every REAP_EVERY_S; never fails the call."""
    now = time.monotonic()
    with _live_lock:
        if now - _last_reap[0] < REAP_EVERY_S:
            return
        _last_reap[0] = now
    try:
        found = client.api.containers(all=True, filters={"label": LABEL_WORKER})
    except (DockerException, requests.RequestException) as exc:
        log.warning("cannot list containers to remove those of dead workers: %s", _reason(exc))
        return
    for info in found:
        holder = (info.get("Labels") or {}).get(LABEL_WORKER, "")
        if dead_here(holder):
            with contextlib.suppress(DockerException, requests.RequestException):
                client.api.remove_container(info["Id"], v=True, force=True)
                log.warning("removed container %s of dead worker %s (job %s)", info["Id"][:12],
                            holder, (info.get("Labels") or {}).get(LABEL_JOB))


# ---------------------------------------------------------------- running


def container_config(
    spec: ToolSpec, argv: list[str], ctx: ToolContext, *, stdin: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The keyword arguments of the low-level `create_container` and `create_host_config`
    for one call (see the module docstring)."""
    if spec.image is None:
        raise ToolError(f"tool {spec.name!r} has no image")
    limits = spec.limits
    workspace = ctx.workspace.stat()
    mib = 1024 * 1024
    memory = limits.memory_mb * mib
    create = {
        "image": spec.image,
        "command": list(argv) or None,  # none: the image's CMD
        "user": f"{workspace.st_uid}:{workspace.st_gid}",  # the workspace's owner, as for tools
        "working_dir": spec.workdir or WORKSPACE,
        "environment": {**spec.env, **ctx.identity.env()},  # the attempt, as for tools
        "labels": {LABEL_JOB: ctx.job_id, LABEL_ACTION: ctx.action_id, LABEL_TOOL: spec.name,
                   LABEL_WORKER: owner()},
        "tty": False,
        "stdin_open": stdin,
        "detach": not stdin,  # with stdin_open: StdinOnce, stdin closes when we stop writing
        "use_config_proxy": False,  # no proxy variables from the worker's docker config
    }
    host = {
        "network_mode": spec.network or "none",
        "mem_limit": memory,
        "memswap_limit": memory,  # no swap beyond the memory limit
        "nano_cpus": int((spec.cpus or DEFAULT_CPUS) * 1e9),
        "pids_limit": limits.processes,
        "ulimits": [
            Ulimit(name="cpu", soft=limits.cpu_seconds, hard=limits.cpu_seconds + 1),
            Ulimit(name="fsize", soft=limits.file_mb * mib, hard=limits.file_mb * mib),
            Ulimit(name="core", soft=0, hard=0),
        ],
        "read_only": spec.read_only is not False,
        "tmpfs": {"/tmp": f"rw,nosuid,nodev,size={limits.file_mb}m"},
        "binds": {str(ctx.workspace): {"bind": WORKSPACE, "mode": "rw"}},
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "privileged": False,
        "log_config": LogConfig(type=LogConfig.types.NONE),
    }
    return create, host


def run_container(
    spec: ToolSpec,
    argv: list[str],
    ctx: ToolContext,
    *,
    stdin: bytes | None = None,
    raise_timeout: bool = True,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
) -> ContainerResult:
    """Run `argv` (empty: the image's CMD) in a new container of `spec.image`; return its exit
    code and output. The budget is `ctx.timeout` seconds, from this call on.

    Raises ToolError when the daemon is unreachable, the image is missing or the container
    cannot be created or started; ToolTimeout on timeout (after killing the container) unless
    `raise_timeout=False` (then the result has `timed_out=True`). The container is always
    removed before returning or raising.
    """
    started = time.monotonic()
    deadline = started + ctx.timeout
    settings = ctx.settings
    create, host = container_config(spec, argv, ctx, stdin=stdin is not None)
    client = connect(settings)
    try:
        _check_image(client, spec, settings)
        _install_sigterm_handler()
        _reap_orphans(client)
        try:
            host_config = client.api.create_host_config(**host)
            created = client.api.create_container(**create, host_config=host_config)
            container = client.containers.prepare_model({"Id": created["Id"]})
        except ImageNotFound:
            raise _missing_image(spec) from None
        except APIError as exc:
            raise ToolError(f"cannot create the container: {_explain(exc)}") from None
        except (DockerException, requests.RequestException) as exc:
            raise _lost(settings, exc, "creating the container") from None
        with _registered(container.id, settings):
            try:
                result = _run(container, stdin, started, deadline, max_output_bytes, settings)
            finally:
                _remove(container)
    finally:
        client.close()
    if result.timed_out and raise_timeout:
        raise ToolTimeout(
            f"timed out after {ctx.timeout:g}s (the container was killed)",
            detail=tail(result.stderr),
        )
    return result


def _check_image(client: docker.DockerClient, spec: ToolSpec, settings: Settings) -> None:
    try:
        client.images.get(spec.image)
    except ImageNotFound:
        raise _missing_image(spec) from None
    except APIError as exc:
        raise ToolError(f"cannot look up image {spec.image!r}: {_explain(exc)}") from None
    except (DockerException, requests.RequestException) as exc:
        raise _lost(settings, exc, f"looking up image {spec.image!r}") from None


def _missing_image(spec: ToolSpec) -> ToolError:
    return ToolError(
        f"image {spec.image!r} is not available on this docker host; build or pull it first "
        f"(tool {spec.name!r}; images are never pulled implicitly)"
    )


def _explain(exc: APIError) -> str:
    return _reason(exc.explanation or exc, 500)


def _run(
    container: Container,
    stdin: bytes | None,
    started: float,
    deadline: float,
    cap: int,
    settings: Settings,
) -> ContainerResult:
    params = {"stdin": 1 if stdin is not None else 0, "stdout": 1, "stderr": 1, "stream": 1}
    try:
        attached = container.attach_socket(params=params)
    except (DockerException, requests.RequestException) as exc:
        raise _lost(settings, exc, "attaching to the container") from None
    sock: socket.socket = getattr(attached, "_sock", attached)
    capture = _Capture(sock, cap)
    reader = threading.Thread(target=capture.read, name="container-output", daemon=True)
    reader.start()
    writer = None
    try:
        try:
            container.start()
        except APIError as exc:
            raise ToolError(f"cannot start the container: {_explain(exc)}") from None
        except (DockerException, requests.RequestException) as exc:
            raise _lost(settings, exc, "starting the container") from None
        if stdin is not None:
            writer = threading.Thread(target=capture.write, args=(stdin,), daemon=True,
                                      name="container-input")
            writer.start()
        timed_out = False
        try:
            status = container.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except requests.RequestException as exc:
            if time.monotonic() < deadline - 0.1:  # not our timeout: the daemon went away
                raise _lost(settings, exc, "waiting for the container") from None
            timed_out = True
            with contextlib.suppress(APIError, requests.RequestException):
                container.kill()
            try:
                status = container.wait(timeout=EXIT_GRACE_S)
            except (DockerException, requests.RequestException) as exc:
                raise _lost(settings, exc, "killing the container") from None
        except DockerException as exc:
            raise _lost(settings, exc, "waiting for the container") from None
        duration = time.monotonic() - started
        reader.join(DRAIN_GRACE_S)  # the attach stream ends with the container
        oom = _oom_killed(container, int(status.get("StatusCode", -1)), timed_out)
    finally:
        capture.close()
        reader.join(DRAIN_GRACE_S)
        if writer is not None:
            writer.join(DRAIN_GRACE_S)
        with contextlib.suppress(OSError):
            attached.close()
    return ContainerResult(
        exit_code=int(status.get("StatusCode", -1)),
        stdout=bytes(capture.out),
        stderr=bytes(capture.err),
        timed_out=timed_out,
        duration_s=duration,
        oom_killed=oom,
        stdout_truncated=capture.out_truncated,
        stderr_truncated=capture.err_truncated,
    )


def _remove(container: Container) -> None:
    try:
        container.remove(v=True, force=True)
    except NotFound:
        pass
    except (DockerException, requests.RequestException) as exc:
        if "already in progress" not in str(exc):
            log.warning("could not remove container %s: %s", container.short_id, exc)


class _Capture:
    """Read the multiplexed attach stream into capped stdout/stderr buffers; feed stdin."""

    def __init__(self, sock: socket.socket, cap: int) -> None:
        self.sock = sock
        self.cap = cap
        self.out = bytearray()
        self.err = bytearray()
        self.out_truncated = False
        self.err_truncated = False

    def read(self) -> None:
        try:
            for stream, data in frames_iter(self.sock, tty=False):
                if stream == 2:
                    buf = self.err
                elif stream == 1:
                    buf = self.out
                else:
                    continue
                room = self.cap - len(buf)
                if len(data) > room:
                    if buf is self.out:
                        self.out_truncated = True
                    else:
                        self.err_truncated = True
                if room > 0:
                    buf += data[:room]
        except (OSError, ValueError):
            pass  # closed: the run is over

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                sent = self.sock.send(view[:_CHUNK])
                view = view[sent:]
            self.sock.shutdown(socket.SHUT_WR)  # EOF: the container's stdin closes
        except OSError:
            pass  # the container stopped reading or exited

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader and the writer


def tail(data: bytes, limit: int = 2000) -> str:
    """The last `limit` characters of an output, decoded."""
    text = data.decode("utf-8", errors="replace").strip()
    return text if len(text) <= limit else "…" + text[-limit:]
