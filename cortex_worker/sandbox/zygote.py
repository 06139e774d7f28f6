"""The warm runner's fork server: `python -m cortex_worker.sandbox.zygote FD module`.

Started by `cortex_worker.sandbox.warm` with the interpreter, flags, environment and
`PYTHONPATH` of the cold runner (`-m cortex_worker.sandbox.function_main module:function`), it imports
the tool's module once, then forks one child per call, and never runs a call itself: a call
that changes the module's globals changes its own copy.

Each child is set up the way `run_sandboxed` sets up a cold runner: its own process group
(set by the zygote too, so it exists before the worker may kill it), the namespaces, mounts
and sandbox user of `isolation.plan`, the call's rlimits, an environment built from scratch
(shown in its /proc/PID/environ, with the cold command as its cmdline: `ps` shows it as a
cold call), only the call's stdin/stdout/stderr open, the workspace as working directory;
then it runs `runner.main`. To keep that set-up off the call's path, the
zygote forks the child for the *next* call as soon as it hands one out: this *spare* creates
its namespaces and mounts (all but the workspace, see `isolation.plan(workspace=...)`) and
waits. The zygote offers it to the worker, which sends the next call straight to it when it
fits, so the zygote is not on the call's path at all (it only learns that the spare was
taken). A call whose isolation differs from the spare's in more than the workspace (another
directory of the same parent) goes through the zygote, which forks a child for it and drops
the spare.

Protocol, over SOCK_SEQPACKET sockets, one JSON object a message:

- control socket FD, worker to zygote: a request (`encode`), with four descriptors: the call's
  stdin, stdout and stderr, and a socket of its own for the call; or `{"taken": P}` with the
  call's socket only: the worker sent a request, with the three others, straight to the
  spare P it was offered;
- zygote to worker, once, after the import: `{"threads": N}` (more than 1: it cannot fork
  safely and exits); then `{"spare": P, "isolation": ...}` with a socket to the spare P, each
  time one is ready for the next call (it replaces the one offered before);
- spare socket, worker (or zygote) to spare: the request and the call's stdin, stdout and
  stderr;
- call socket, zygote to worker: `{"pid": P}` once the call has a process (or the zygote took
  note that it has one), `{"returncode": R}` once that exited. The zygote reaps it only when the worker closes the call socket, after
  killing its process group: until then the group id cannot be reused. A call socket closed
  before the process exited (the worker has the call's answer, or it died) has the zygote
  kill the process group and reap it once it exited.

The zygote exits when the control socket closes (the worker retired it or died) and its calls
have ended, or after IDLE_S without calls. Its children die with it (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import json
import os
import selectors
import shutil
import signal
import socket
import sys
import traceback
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

from cortex_worker.sandbox import function_main as runner
from cortex_worker.sandbox.isolation import FAILED, Isolation, fail, plan
from cortex_worker.sandbox.process import Rlimits, set_rlimits

IDLE_S = 600.0
"""A zygote without calls for this long exits (the worker starts another when needed)."""
MAX_MESSAGE = 1 << 20
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_MM, PR_SET_MM_MAP = 35, 14
_libc = ctypes.CDLL(None)  # loaded once, in the zygote, not in each call (0.1 ms a load)
_libc.sbrk.restype = ctypes.c_void_p


@dataclass(frozen=True)
class Request:
    """One call: the cold runner's command it stands for (`... -m function_main
    module:function`), where it runs, its whole environment, rlimits and namespaces."""

    argv: Sequence[str]
    cwd: Path
    env: Mapping[str, str]
    rlimits: Rlimits
    isolation: Isolation | None

    @property
    def entrypoint(self) -> str:
        """`module:function`, the runner's argument."""
        return self.argv[-1]


def encode(request: Request) -> bytes:
    """The request as the zygote reads it."""
    return json.dumps({"argv": list(request.argv), "cwd": str(request.cwd),
                       "env": dict(request.env), "rlimits": request.rlimits,
                       "isolation": encode_isolation(request.isolation)}).encode()


def decode(data: bytes) -> Request:
    """The request `encode` made."""
    raw = json.loads(data)
    return Request(argv=raw["argv"], cwd=Path(raw["cwd"]), env=raw["env"],
                   rlimits=[(which, (soft, hard)) for which, (soft, hard) in raw["rlimits"]],
                   isolation=decode_isolation(raw["isolation"]))


def encode_isolation(iso: Isolation | None) -> dict[str, Any] | None:
    """An isolation as JSON."""
    return None if iso is None else {
        **asdict(iso), "writable": str(iso.writable),
        "hide": None if iso.hide is None else str(iso.hide),
        "readable": [str(p) for p in iso.readable]}


def decode_isolation(iso: dict[str, Any] | None) -> Isolation | None:
    """The isolation `encode_isolation` made."""
    return None if iso is None else Isolation(
        writable=Path(iso["writable"]), hide=None if iso["hide"] is None else Path(iso["hide"]),
        readable=tuple(Path(p) for p in iso["readable"]), network=iso["network"],
        user=None if iso["user"] is None else (iso["user"][0], iso["user"][1]))


def fits(spare: Isolation | None, call: Isolation | None) -> bool:
    """Whether a spare set up for `spare` can serve a call isolated as `call`: the same but
    for the workspace, which must be a directory of the same parent."""
    if spare is None or call is None:
        return spare is call
    return (replace(call, writable=spare.writable) == spare
            and call.writable.resolve().parent == spare.writable.resolve().parent)


def main(argv: list[str] | None = None) -> int:
    """Import the tool's module, say how many threads that left, then serve calls."""
    argv = sys.argv[1:] if argv is None else argv
    control = socket.socket(fileno=int(argv[0]))
    home = os.getcwd()  # a directory of its own, for what the import may write
    # on failure each call imports it again, in its sandbox, and reports the error as usual
    with contextlib.suppress(Exception, SystemExit):
        importlib.import_module(argv[1])
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # what the import printed is not repeated in every call's output
    os.chdir("/")
    shutil.rmtree(home, ignore_errors=True)
    _memory_layout()  # read once, for every call (`_show_as_exec`)
    gc.freeze()  # a child's collections leave the zygote's objects alone: fewer pages copied
    threads = len(os.listdir("/proc/self/task"))
    control.send(json.dumps({"threads": threads}).encode())
    if threads == 1:
        _Server(control).serve()
    return 0


@dataclass
class Spare:
    """A child set up for a call that has not come yet, and a socket to hand it one."""

    pid: int
    sock: socket.socket
    isolation: Isolation | None


class _Server:
    """The zygote's loop: hand calls to spares, report their exits, reap them when done."""

    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.sel = selectors.DefaultSelector()
        self.sel.register(control, selectors.EVENT_READ, ("request", 0))
        self.open = True
        self.calls: dict[int, tuple[socket.socket | None, int | None]] = {}  # pid: call socket, pidfd
        self.spare: Spare | None = None

    def serve(self) -> None:
        try:
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
        finally:
            self._drop_spare()

    def _request(self, control: socket.socket) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE, 4)
        except OSError:
            data, fds = b"", []
        if not data or len(fds) not in (1, 4):
            for fd in fds:
                os.close(fd)
            if not data:
                self.sel.unregister(control)
                control.close()
                self.open = False
            return
        call = socket.socket(fileno=fds[-1])
        if len(fds) == 1:  # {"taken": P}: the worker sent the call to the spare it was offered
            self._taken(int(json.loads(data)["taken"]), call)
            return
        isolation = decode(data).isolation
        self._keep_spare_for(isolation)
        try:
            child = self._fork(isolation, stderr=fds[2])  # its set-up errors are the call's
            socket.send_fds(child.sock, [data], fds[:3])
        except OSError as exc:
            _send(call, {"error": f"cannot start the tool process: {exc}"})
            call.close()
            return
        finally:
            for fd in fds[:3]:
                os.close(fd)
        self._started(child, call)

    def _taken(self, pid: int, call: socket.socket) -> None:
        spare = self.spare
        if spare is None or spare.pid != pid:  # dropped before the worker read its offer
            _send(call, {"error": f"the tool process {pid} was not waiting for a call",
                         "stale": True})
            call.close()
            return
        self.spare = None
        self._started(spare, call)

    def _started(self, child: Spare, call: socket.socket) -> None:
        """A child has its call: watch it for the worker; fork and offer the next spare."""
        child.sock.close()
        self.calls[child.pid] = (call, os.pidfd_open(child.pid))
        self.sel.register(self.calls[child.pid][1], selectors.EVENT_READ, ("exit", child.pid))
        self.sel.register(call, selectors.EVENT_READ, ("done", child.pid))
        _send(call, {"pid": child.pid})
        if self.spare is not None:
            return
        with contextlib.suppress(OSError):  # without one, the next call forks its own
            self.spare = self._fork(child.isolation, stderr=None)
            socket.send_fds(self.control, [json.dumps({
                "spare": self.spare.pid,
                "isolation": encode_isolation(self.spare.isolation)}).encode()],
                [self.spare.sock.fileno()])

    def _keep_spare_for(self, isolation: Isolation | None) -> None:
        """A call came through here: the spare, offered to the worker, is not handed out
        (the worker may be sending it a call). It is dropped if it died or does not fit this
        call's isolation (later calls likely share it), and kept otherwise."""
        spare = self.spare
        if spare is not None:
            alive = os.waitpid(spare.pid, os.WNOHANG) == (0, 0)  # a failed set-up ended it
            if not (alive and fits(spare.isolation, isolation)):
                self.spare = None
                _drop(spare, reaped=not alive)

    def _fork(self, isolation: Isolation | None, stderr: int | None) -> Spare:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        zygote = os.getpid()
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            raise
        if pid == 0:
            _child(isolation, theirs, zygote, stderr)
        os.setpgid(pid, pid)  # the child does it too: whichever runs first, the group exists now
        theirs.close()
        return Spare(pid, ours, isolation)

    def _drop_spare(self) -> None:
        if self.spare is not None:
            _drop(self.spare, reaped=False)
            self.spare = None

    def _exited(self, pid: int) -> None:
        call, pidfd = self.calls[pid]
        assert pidfd is not None
        self.sel.unregister(pidfd)
        os.close(pidfd)
        if call is None:  # the worker is done with it already (see `_done`)
            del self.calls[pid]
            os.waitpid(pid, 0)
            return
        self.calls[pid] = (call, None)
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        code = 0 if info is None else info.si_status
        killed = info is not None and info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        _send(call, {"returncode": -code if killed else code})

    def _done(self, pid: int) -> None:
        """The worker closed the call socket: after the exit was reported, reap the process;
        before (the worker has the call's answer, or it went away), kill its group and reap
        it once it has exited, without holding up the next call."""
        call, pidfd = self.calls[pid]
        assert call is not None
        self.sel.unregister(call)
        call.close()
        if pidfd is None:
            del self.calls[pid]
            os.waitpid(pid, 0)
        else:
            os.killpg(pid, signal.SIGKILL)  # not reaped yet: the group id is still its own
            self.calls[pid] = (None, pidfd)


def _drop(spare: Spare, *, reaped: bool) -> None:
    spare.sock.close()
    if not reaped:
        os.killpg(spare.pid, signal.SIGKILL)  # not reaped yet: the group id is still its own
        os.waitpid(spare.pid, 0)


def _send(call: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the worker went away: the loop sees the socket end
        call.send(json.dumps(message).encode())


def _child(isolation: Isolation | None, sock: socket.socket, zygote: int,
           stderr: int | None) -> NoReturn:
    """A spare, in the forked child: set up as `run_sandboxed` sets a process up, the
    workspace and the call's descriptors last, then run the call."""
    received: list[Request] = []

    def receive() -> Path:
        """Wait for the call (in the tool process, the sandbox set up but for the workspace)."""
        data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 3)
        if not data or len(fds) != 3:
            os._exit(0)  # dropped by the zygote
        for fd, target in zip(fds, (0, 1, 2), strict=True):
            os.dup2(fd, target)
        received.append(decode(data))
        iso = received[0].isolation
        return received[0].cwd if iso is None else iso.writable

    try:
        if stderr is not None:
            os.dup2(stderr, 2)  # set-up errors before the call arrives are the call's
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != zygote:
            os._exit(FAILED)  # it died already
        os.setpgid(0, 0)  # its own process group, which the worker kills (the zygote has no tty)
        if isolation is None:
            receive()
        else:
            plan(isolation, workspace=receive)()  # returns in the tool process only
        request = received[0]
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the zygote's sockets above all
        os.chdir(request.cwd)
        os.environ.clear()
        os.environ.update(request.env)
        _show_as_exec(request.argv, request.env)
        set_rlimits(request.rlimits)
    except Exception as exc:  # reported as isolation.py reports its own
        fail(f"cannot start the tool in the sandbox: {exc}")
    _run(request.entrypoint)


class _MmMap(ctypes.Structure):
    """`struct prctl_mm_map` (linux/prctl.h): where the kernel finds a process's memory areas."""

    _fields_ = [*((name, ctypes.c_uint64) for name in (
        "start_code", "end_code", "start_data", "end_data", "start_brk", "brk", "start_stack",
        "arg_start", "arg_end", "env_start", "env_end")),
        ("auxv", ctypes.c_void_p), ("auxv_size", ctypes.c_uint32), ("exe_fd", ctypes.c_uint32)]


_shown: list[ctypes.Array[ctypes.c_char]] = []  # what /proc reads: kept for the process's life


@cache
def _memory_layout() -> dict[str, int] | None:
    """The areas PR_SET_MM_MAP is given back as they are (fields of /proc/self/stat, proc(5)):
    read once, in the zygote (`main`), and the same in every process it forks."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        field = stat[stat.rindex(b")") + 2:].split()  # field 3 onwards
        return {name: int(field[number - 3]) for name, number in (
            ("start_code", 26), ("end_code", 27), ("start_stack", 28), ("start_data", 45),
            ("end_data", 46), ("start_brk", 47))}
    except (OSError, ValueError, IndexError):
        return None


def _show_as_exec(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """Make this process's /proc/PID/cmdline and /proc/PID/environ (what `ps` and `ps e`
    show) the call's command and environment, as an exec of the cold runner would have made
    them. A forked process shows its zygote's instead (another command and HOME, no
    CORTEX_JOB_ID or CORTEX_ATTEMPT), so an operator, or a check that looks for an attempt's
    process by its variables, would not find a warm call. PR_SET_MM_MAP points the kernel at
    new copies and needs no privilege; a kernel without it (no CONFIG_CHECKPOINT_RESTORE)
    leaves the zygote's, and the call runs all the same. Dumpable again, as after an exec: a
    process that changed its uid (to the sandbox user) is not, and its /proc/PID files then
    belong to root: the call could not read its own /proc/self/environ."""
    _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    layout = _memory_layout()
    if layout is None:
        return

    def block(items: Iterable[str]) -> ctypes.Array[ctypes.c_char]:
        data = b"".join(os.fsencode(item) + b"\0" for item in items)
        _shown.append(ctypes.create_string_buffer(data, len(data)))
        return _shown[-1]

    args, environ = block(argv), block(f"{k}={v}" for k, v in env.items())
    mm = _MmMap(**layout, auxv=None, auxv_size=0, exe_fd=0xFFFFFFFF)  # auxv, exe as they are
    mm.arg_start, mm.arg_end = ctypes.addressof(args), ctypes.addressof(args) + len(args)
    mm.env_start, mm.env_end = ctypes.addressof(environ), ctypes.addressof(environ) + len(environ)
    ref, size = ctypes.byref(mm), ctypes.sizeof(mm)
    mm.brk = _libc.sbrk(0)  # the heap's end now: nothing allocates between this and the prctl
    _libc.prctl(PR_SET_MM, PR_SET_MM_MAP, ref, size, 0)


def _run(entrypoint: str) -> NoReturn:
    """`python -m cortex_worker.sandbox.function_main entrypoint`, in this process."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the relay reset it
    sys.argv = [runner.__file__, entrypoint]
    status, interrupted = 1, False
    try:
        status = runner.main([entrypoint])
    except BaseException as exc:  # as an interpreter does with an uncaught one
        traceback.print_exc()
        interrupted = isinstance(exc, KeyboardInterrupt)
    finally:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        if interrupted:  # an interpreter ends by SIGINT then: the call says "killed by SIGINT"
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
