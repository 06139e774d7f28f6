"""Warm runners: python tools run from a fork server that imported their module already.

A cold python tool call starts an interpreter, imports the runner and the tool's module, then
calls the function: 80-180 ms before the tool does anything. `run_warm` takes the same
command (`python -P -s -m cortex_worker.sandbox.function_main module:function`) and the same
arguments as `run_sandboxed`, and returns the same result, but the process comes from a
*zygote* (cortex_worker/sandbox/zygote.py): an interpreter started once per tool module and
environment in this worker process, with the module imported, that forks one child per call:
ahead of time, as a *spare* it offers to this process, which hands the next call to that
spare itself, so a warm call's start does not wait for the zygote (zygote.py, its protocol).
The child goes through the same set-up as a cold one (`isolation.plan`: namespaces, mounts,
sandbox user; then the rlimits, a clean environment, only its own pipes open) and is watched
by the same `process.supervise` (timeout, kill of its whole group, `kill_all` on shutdown,
output caps), so the sandbox's guarantees do not depend on which way a call started. The
`python` built-in is such a tool too: its snippets run as `cortex_worker.sandbox.snippet:execute`.

A zygote is retired (it exits once its running calls ended, and the next call starts a fresh
one) after RECYCLE_AFTER calls, after any call that was killed (timeout, a limit, a signal,
shutdown) or failed to set up, when it died (the call is retried once on a new one), and
beyond MAX_ZYGOTES per worker process (the least recently used). The cold runner is used
only where no zygote can serve, and the reason is logged once per command: the module starts
threads when imported (forking a threaded process can deadlock the child), the zygote died
while importing it, or this kernel has no pidfds (Linux < 5.3). A zygote that is still
importing when the call's timeout runs out also hands that one call to the cold runner.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import IO

from cortex_worker.sandbox import zygote
from cortex_worker.sandbox.function_main import parse_last_line
from cortex_worker.sandbox.isolation import Isolation
from cortex_worker.sandbox.process import (
    DEFAULT_MAX_OUTPUT_BYTES,
    SandboxError,
    SandboxResult,
    checked_cwd,
    rlimits,
    run_sandboxed,
    sandbox_env,
    supervise,
)
from cortex_worker.tools.spec import Limits

log = logging.getLogger(__name__)

RUNNER = "cortex_worker.sandbox.function_main"
ZYGOTE = "cortex_worker.sandbox.zygote"
RECYCLE_AFTER = 500
"""Calls a zygote forks before it is retired."""
MAX_ZYGOTES = 8
"""Zygotes per worker process (one per tool module and environment in use)."""

Key = tuple[tuple[str, ...], tuple[tuple[str, str], ...]]
"""The interpreter with its flags and the module, and the environment of the tool."""


class _Gone(Exception):
    """The zygote is not there any more (it died, or exited after IDLE_S without calls)."""


class _Call:
    """A call a zygote forked. The zygote is its parent: it reports the exit on the call
    socket and reaps the process only when that socket is closed, after `wait`."""

    def __init__(self, pid: int, sock: socket.socket, stdin: IO[bytes] | None,
                 stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.pid, self.sock = pid, sock
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr

    def exit_fd(self) -> int | None:
        return os.dup(self.sock.fileno())

    def exited(self) -> bool:
        return bool(select.select([self.sock], [], [], 0)[0])

    def wait(self) -> int:
        self.sock.settimeout(None)
        try:
            reply = self.sock.recv(4096)
        except OSError:
            reply = b""
        self.sock.close()
        # no reply: the zygote died, and its children with it (PR_SET_PDEATHSIG)
        return int(json.loads(reply)["returncode"]) if reply else -signal.SIGKILL

    def release(self) -> None:
        self.sock.close()  # the zygote kills the group if need be, and reaps it


def _kill_taken(pid: int | None) -> None:
    """The spare that took a call whose zygote is gone may have begun it: it must not run
    beside the call's retry."""
    if pid is not None:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


class _Zygote:
    """One fork server: its process, its control socket, how many calls it forked."""

    def __init__(self, key: Key) -> None:
        (*python, module), env = key
        home = Path(tempfile.mkdtemp(prefix="cortex-zygote-"))  # it removes it after the import
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [*python, ZYGOTE, str(theirs.fileno()), module], cwd=home,
                env=sandbox_env(home, dict(env)), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),), start_new_session=True)
        except OSError:
            ours.close()
            shutil.rmtree(home, ignore_errors=True)
            raise
        finally:
            theirs.close()
        self.sock = ours
        self.calls = 0
        self.lock = threading.Lock()
        self.unusable: str | None = None
        self.ready = False
        self.spare: zygote.Spare | None = None  # the last one offered

    def wait_ready(self, timeout: float) -> bool:
        """Whether it serves calls, once its module is imported; else `unusable` says why
        (None: it was still importing after `timeout`)."""
        with self.lock:
            if not self.ready and self.unusable is None:
                if not select.select([self.sock], [], [], timeout)[0]:
                    return False
                reply = self.sock.recv(4096)
                threads = json.loads(reply)["threads"] if reply else 0
                if not reply:
                    self.unusable = "the zygote exited while importing the module"
                elif threads > 1:
                    self.unusable = (f"the module starts threads when imported ({threads} "
                                     "threads): forking a threaded process is unsafe")
                self.ready = self.unusable is None
            return self.ready

    def spawn(self, request: bytes, stdin: bytes | None, timeout: float,
              isolation: Isolation | None) -> _Call:
        """Fork one call with fresh pipes: straight to the spare the zygote offered if it fits
        `isolation`, else through the zygote. Raises _Gone if the zygote is not there."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        in_r, in_w = os.pipe() if stdin is not None else (os.open(os.devnull, os.O_RDONLY), -1)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        taken = None
        try:
            reply = b""
            if self.proc.poll() is None:
                with self.lock:  # one order for what reaches the zygote: offers are not reused
                    taken = self._give_spare(request, [in_r, out_w, err_w], isolation)
                    if taken is not None:
                        message, fds = json.dumps({"taken": taken}).encode(), [theirs.fileno()]
                    else:
                        message, fds = request, [in_r, out_w, err_w, theirs.fileno()]
                    socket.send_fds(self.sock, [message], fds)
                reply = self._reply(ours, timeout)
        except OSError:
            reply = b""
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
            theirs.close()
        if not reply:
            for fd in (in_w, out_r, err_r):
                if fd >= 0:
                    os.close(fd)
            ours.close()
            _kill_taken(taken)
            raise _Gone
        self.calls += 1
        answer = json.loads(reply)
        if "error" in answer:
            for fd in (in_w, out_r, err_r):
                if fd >= 0:
                    os.close(fd)
            ours.close()
            if answer.get("stale"):  # a spare dropped as it took the call: start afresh
                _kill_taken(taken)
                raise _Gone
            raise SandboxError(answer["error"])
        return _Call(answer["pid"], ours, open(in_w, "wb", buffering=0) if in_w >= 0 else None,
                     open(out_r, "rb", buffering=0), open(err_r, "rb", buffering=0))

    def _give_spare(self, request: bytes, fds: list[int], isolation: Isolation | None) -> int | None:
        """Send the call to the spare last offered, if it fits `isolation` and lives: its
        pid, else None (the call then goes through the zygote). Either way the offer is used
        up: a spare the zygote hands a call to, or drops, is offered no more."""
        self._read_offers()
        spare, self.spare = self.spare, None
        if spare is None:
            return None
        try:
            if not zygote.fits(spare.isolation, isolation):
                return None
            socket.send_fds(spare.sock, [request], fds)
        except OSError:  # it died while it waited: the zygote forks one for the call
            return None
        finally:
            spare.sock.close()
        return spare.pid

    def _read_offers(self) -> None:
        """Take the zygote's offers of spares waiting on the control socket: the last one
        counts."""
        while select.select([self.sock], [], [], 0)[0]:  # a whole message is there
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, 64 * 1024, 1)
            except OSError:  # the zygote is gone: the call finds out
                return
            if not data:
                for fd in fds:
                    os.close(fd)
                return
            self._drop_offer()
            if len(fds) == 1:
                offer = json.loads(data)
                self.spare = zygote.Spare(int(offer["spare"]), socket.socket(fileno=fds[0]),
                                          zygote.decode_isolation(offer["isolation"]))
            else:
                for fd in fds:
                    os.close(fd)

    def _drop_offer(self) -> None:
        if self.spare is not None:
            self.spare.sock.close()
            self.spare = None

    def _reply(self, call: socket.socket, timeout: float) -> bytes:
        """The zygote's answer on the call's socket; b"" if the zygote exits first. A request
        sent as the zygote dies can go unanswered until the timeout: its control socket lives
        on in a spare that is dying too, and the kernel may release the call's socket (in
        flight in that request) only later, so no end of file comes."""
        exited = os.pidfd_open(self.proc.pid)  # not reaped yet: the pid is still its own
        try:
            ready, _, _ = select.select([call, exited], [], [], timeout)
        finally:
            os.close(exited)
        return call.recv(4096) if call in ready else b""

    def retire(self) -> None:
        """Stop sending it calls: it exits once those running have ended."""
        with self.lock:
            self._drop_offer()
        self.sock.close()


class _Owner:
    """The lock of the tables below and the process whose children their zygotes are."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = os.getpid()

    def forked(self) -> None:
        """A child forked while another thread held the lock must not wait for it forever
        (its parent's zygotes are dropped at its first call, `_zygote_for`)."""
        self.lock = threading.Lock()


_here = _Owner()
os.register_at_fork(after_in_child=_here.forked)  # every fork, not only a worker's children
_zygotes: dict[Key, _Zygote] = {}  # least recently used first
_retired: list[_Zygote] = []
_cold: dict[Key, str] = {}


def run_warm(
    argv: Sequence[str],
    *,
    stdin: bytes | None = None,
    cwd: Path,
    timeout: float,
    limits: Limits | None = None,
    env: Mapping[str, str] | None = None,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    isolation: Isolation | None = None,
    call_env: Mapping[str, str] | None = None,
) -> SandboxResult:
    """`run_sandboxed(argv, ...)` for the cold runner's command `argv`, forked from a warm
    zygote; the cold runner only where no zygote can serve (see the module docstring).
    `call_env` is added to this call's environment only: the zygote, shared by the calls of
    one `env`, does not have it (the action's attempt, which differs on every call)."""
    if list(argv[-3:-1]) != ["-m", RUNNER]:
        raise ValueError(f"not a runner command: {list(argv)}")
    cwd = checked_cwd(cwd, timeout)
    limits = limits or Limits()
    started = time.monotonic()
    module = argv[-1].partition(":")[0]
    key: Key = ((*argv[:-2], module), tuple(sorted((env or {}).items())))
    whole = {**(env or {}), **(call_env or {})}
    request = zygote.encode(zygote.Request(argv, cwd, sandbox_env(cwd, whole),
                                           rlimits(limits), isolation))
    for _ in range(2):  # a zygote found dead is replaced once
        server = _zygote_for(key, timeout)
        if server is None:
            break
        try:
            call = server.spawn(request, stdin, timeout, isolation)
        except _Gone:
            _retire(key, server)
            continue
        result = None
        try:
            result = supervise(call, stdin=stdin, started=started, timeout=timeout,
                               max_output_bytes=max_output_bytes, finished=_answered)
        finally:
            if result is None or result.killed_by is not None or result.timed_out \
                    or server.calls >= RECYCLE_AFTER:
                _retire(key, server)
        return result
    return run_sandboxed(argv, stdin=stdin, cwd=cwd, timeout=timeout, limits=limits, env=whole,
                         max_output_bytes=max_output_bytes, isolation=isolation,
                         finished=_answered)


def _answered(stdout: bytes) -> bool:
    """Whether a runner's output holds its result line: the call is over once it also
    closed its output (its init and relay then exit on their own time)."""
    return parse_last_line(stdout) is not None


def _zygote_for(key: Key, timeout: float) -> _Zygote | None:
    """The ready zygote of `key`, started if needed; None: this call runs cold."""
    with _here.lock:
        if _here.pid != os.getpid():  # a forked worker process: those zygotes are its parent's
            _here.pid = os.getpid()
            _zygotes.clear()
            _retired.clear()
        _reap_retired()
        if key in _cold:
            return None
        if not pidfds():
            _go_cold(key, "this kernel has no pidfds (Linux 5.3 or later)")
            return None
        server = _zygotes.pop(key, None)
        if server is None:
            try:
                server = _Zygote(key)
            except OSError as exc:
                log.warning("cannot start a warm runner for %s: %s", key[0][-1], exc)
                return None
        _zygotes[key] = server
        while len(_zygotes) > MAX_ZYGOTES:
            _retire_locked(next(iter(_zygotes)))
    if server.wait_ready(timeout):
        return server
    with _here.lock:
        if server.unusable is not None:
            _go_cold(key, server.unusable)
        if _zygotes.get(key) is server:
            _retire_locked(key)
    return None


def _go_cold(key: Key, reason: str) -> None:
    _cold[key] = reason
    log.warning("python tool %s runs cold (a new interpreter per call): %s", key[0][-1], reason)


def _retire(key: Key, server: _Zygote) -> None:
    with _here.lock:
        if _zygotes.get(key) is server:
            _retire_locked(key)


def _retire_locked(key: Key) -> None:
    server = _zygotes.pop(key)
    server.retire()
    _retired.append(server)


def _reap_retired() -> None:
    """Forget retired zygotes that have exited (reaping them)."""
    _retired[:] = [z for z in _retired if z.proc.poll() is None]


@cache
def pidfds() -> bool:
    """Whether this kernel gives pidfds, which a zygote watches its calls with."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True
