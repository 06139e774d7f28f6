"""The warm runner's fork server: `python -m cortex_worker.sandbox.zygote FD module:function`.

Started by `cortex_worker.sandbox.warm` with the same interpreter, flags, environment and
`PYTHONPATH` as the cold runner (`-m cortex_worker.sandbox.runner module:function`), it imports
the tool's module once, then forks one child per call. Each child is set up the way
`run_sandboxed` sets up the cold runner: its stdin/stdout/stderr are the call's pipes, every
other descriptor is closed, it changes to the workspace, starts a session, takes the call's
environment, and goes through `process.preexec` (the namespaces of `isolation.py` and the
rlimits); then, in the tool process, it runs `runner.main`. A call that changes the module's
globals changes its own copy: the next call forks from the zygote again.

The zygote never runs a call. Protocol, over SOCK_SEQPACKET sockets, one JSON object a message:

- control socket FD, worker to zygote: a request (`encode`), with four descriptors: the call's
  stdin, stdout and stderr, and a socket of its own for the call;
- zygote to worker, once, after the import: `{"threads": N}` (more than 1: it cannot fork
  safely and exits);
- call socket, zygote to worker: `{"pid": P}` once forked, `{"returncode": R}` once it exited;
  the zygote reaps it only when the worker closes the call socket, after killing its process
  group: until then the group id cannot be reused. A call socket closed before the child
  exited (the worker died) kills the child's group first.

The zygote exits when the control socket closes (the worker retired it or died) and its calls
have ended, or after IDLE_S without calls.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import selectors
import shutil
import signal
import socket
import sys
import traceback
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

from cortex_worker.sandbox import runner
from cortex_worker.sandbox.isolation import FAILED, Isolation, fail
from cortex_worker.sandbox.process import Rlimits, preexec

IDLE_S = 600.0
"""A zygote without calls for this long exits (the worker starts another when needed)."""
MAX_MESSAGE = 1 << 20
PR_SET_PDEATHSIG = 1


def encode(cwd: Path, env: Mapping[str, str], rlimits: Rlimits,
           isolation: Isolation | None) -> bytes:
    """A call request: where it runs, its whole environment, its rlimits and namespaces."""
    iso = None if isolation is None else {
        **asdict(isolation), "writable": str(isolation.writable),
        "hide": None if isolation.hide is None else str(isolation.hide),
        "readable": [str(p) for p in isolation.readable]}
    return json.dumps({"cwd": str(cwd), "env": dict(env), "rlimits": rlimits,
                       "isolation": iso}).encode()


def decode(data: bytes) -> tuple[str, dict[str, str], Rlimits, Isolation | None]:
    """The request `encode` made."""
    request = json.loads(data)
    iso = request["isolation"]
    isolation = None if iso is None else Isolation(
        writable=Path(iso["writable"]), hide=None if iso["hide"] is None else Path(iso["hide"]),
        readable=tuple(Path(p) for p in iso["readable"]), network=iso["network"],
        user=None if iso["user"] is None else (iso["user"][0], iso["user"][1]))
    rlimits = [(which, (soft, hard)) for which, (soft, hard) in request["rlimits"]]
    return request["cwd"], request["env"], rlimits, isolation


def main(argv: list[str] | None = None) -> int:
    """Import the tool's module, say how many threads that left, then serve calls."""
    argv = sys.argv[1:] if argv is None else argv
    control = socket.socket(fileno=int(argv[0]))
    entrypoint = argv[1]
    home = os.getcwd()  # a directory of its own, for what the import may write
    # on failure each call imports it again, in its sandbox, and reports the error as usual
    with contextlib.suppress(Exception, SystemExit):
        runner.load(entrypoint)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # what the import printed is not repeated in every call's output
    os.chdir("/")
    shutil.rmtree(home, ignore_errors=True)
    threads = len(os.listdir("/proc/self/task"))
    control.send(json.dumps({"threads": threads}).encode())
    if threads == 1:
        _Server(control, entrypoint).serve()
    return 0


class _Server:
    """The zygote's loop: fork calls, report their exits, reap them when the worker is done."""

    def __init__(self, control: socket.socket, entrypoint: str) -> None:
        self.entrypoint = entrypoint
        self.sel = selectors.DefaultSelector()
        self.sel.register(control, selectors.EVENT_READ, ("request", 0))
        self.open = True
        self.calls: dict[int, tuple[socket.socket, int | None]] = {}  # pid: call socket, pidfd

    def serve(self) -> None:
        while self.open or self.calls:
            events = self.sel.select(None if self.calls else IDLE_S)
            if not events and not self.calls:
                return
            for key, _ in events:
                what, pid = key.data
                if what == "request":
                    self._request(key.fileobj)  # type: ignore[arg-type]
                elif what == "exit":
                    self._exited(pid)
                else:
                    self._done(pid)

    def _request(self, control: socket.socket) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE, 4)
        except OSError:
            data, fds = b"", []
        if not data or len(fds) != 4:
            for fd in fds:
                os.close(fd)
            if not data:
                self.sel.unregister(control)
                control.close()
                self.open = False
            return
        call = socket.socket(fileno=fds[3])
        zygote = os.getpid()
        try:
            pid = os.fork()
        except OSError as exc:
            for fd in fds[:3]:
                os.close(fd)
            _send(call, {"error": f"cannot fork the tool process: {exc}"})
            call.close()
            return
        if pid == 0:
            _child(self.entrypoint, data, zygote, *fds[:3])
        for fd in fds[:3]:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.calls[pid] = (call, pidfd)
        self.sel.register(pidfd, selectors.EVENT_READ, ("exit", pid))
        self.sel.register(call, selectors.EVENT_READ, ("done", pid))
        _send(call, {"pid": pid})

    def _exited(self, pid: int) -> None:
        call, pidfd = self.calls[pid]
        assert pidfd is not None
        self.sel.unregister(pidfd)
        os.close(pidfd)
        self.calls[pid] = (call, None)
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        code = 0 if info is None else info.si_status
        killed = info is not None and info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        _send(call, {"returncode": -code if killed else code})

    def _done(self, pid: int) -> None:
        call, pidfd = self.calls.pop(pid)
        self.sel.unregister(call)
        call.close()
        if pidfd is not None:  # still running: the worker went away
            self.sel.unregister(pidfd)
            os.close(pidfd)
            os.killpg(pid, signal.SIGKILL)  # not reaped yet: the group id is still its own
        os.waitpid(pid, 0)


def _send(call: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the worker went away: the loop sees the socket end
        call.send(json.dumps(message).encode())


def _child(entrypoint: str, request: bytes, zygote: int, stdin: int, stdout: int,
           stderr: int) -> NoReturn:
    """One call, in the forked child: set up as `run_sandboxed` sets up a process, then run."""
    try:
        for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the control socket above all
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # dies with the zygote
        if os.getppid() != zygote:
            os._exit(FAILED)  # it died already
        cwd, env, limits, isolation = decode(request)
        os.chdir(cwd)
        os.setsid()
        os.environ.clear()
        os.environ.update(env)
        preexec(limits, isolation)()  # returns in the tool process only
    except Exception as exc:  # reported as isolation.py reports its own
        fail(f"cannot start the tool in the sandbox: {exc}")
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the relay reset it
    sys.argv = [runner.__file__, entrypoint]
    status = 1
    try:
        status = runner.main([entrypoint])
    except BaseException:  # as an interpreter does with an uncaught one
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
