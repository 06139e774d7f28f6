"""Kernel namespaces around a sandboxed process: what it can see, write, signal and reach.

`run_sandboxed(..., isolation=Isolation(...))` starts the command through three processes:

- the *relay* (the process `subprocess` forked, leader of the sandbox's process group)
  `unshare`s new mount, PID, IPC and UTS namespaces (and network, unless the tool has host
  network; and a user namespace when the worker is not root), then waits for the tool's
  status and exits the way the tool exited;
- the *init*, PID 1 of the new PID namespace, mounts a fresh `/proc` (only the sandbox's own
  processes are in it: the worker's environment is out of sight), makes every mount
  read-only, hides the other workspaces behind an empty tmpfs, then reaps children until the
  tool exits. When it exits the kernel kills everything left in the namespace, so a process
  that called `setsid()` dies too;
- the *tool*, which mounts the workspace read-write (the last mount), changes to the sandbox
  user (`nobody` for a root worker) or else drops every capability, sets `no_new_privs` and
  its rlimits, and execs.

A warm runner's spare (cortex_worker/sandbox/zygote.py) goes through the same processes
before its call arrives: `plan(..., workspace=...)` has the tool process wait for it, then
mount the call's workspace, a directory beside the one the spare was planned with.

All of it runs between fork and exec, in Python, with values computed beforehand in the worker.
A failure there is reported on the tool's stderr with the `cortex-sandbox:` prefix and exit
status 126, which `setup_error` reads back (`run_sandboxed` raises it as a `SandboxError`).

Nothing here imports `process`: `unavailable_reason` probes this machine with `plan` alone.
"""

from __future__ import annotations

import ctypes
import errno
import os
import pwd
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import NoReturn

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MS_STRICTATIME = 1 << 24
_KEPT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
               "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME,
               "strictatime": MS_STRICTATIME}

PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
_CAP_VERSION_3 = 0x20080522

FAILED = 126
"""Exit status of a sandbox whose set-up failed (stderr starts with `PREFIX`)."""
PREFIX = b"cortex-sandbox: "
PROBE_TIMEOUT_S = 10


@dataclass(frozen=True)
class Isolation:
    """What a sandboxed process is kept away from."""

    writable: Path
    """The one directory it may write (the job workspace); everything else is read-only."""
    hide: Path | None = None
    """A directory shown empty apart from `writable` (the root of all workspaces)."""
    readable: tuple[Path, ...] = ()
    """Paths the tool must read (interpreter, modules). When `user` could not reach one (a
    directory above it is closed to others, like /root), that directory is shown empty
    apart from these paths."""
    network: bool = True
    """An empty network namespace of its own: no connection anywhere, not even loopback."""
    user: tuple[int, int] | None = None
    """(uid, gid) to run as (a root worker); None keeps the worker's uid, minus capabilities."""


class _Cap(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


@dataclass
class _Plan:
    """Everything the forked processes need, computed in the worker."""

    flags: int
    writable: str
    veils: list[tuple[str, list[str]]]  # (directory shown empty, paths bound back), outer first
    home: str | None  # the veil the workspace is bound into (None: bound over itself)
    writable_flags: int  # per-mount flags of the filesystem holding the workspace
    user: tuple[int, int] | None
    maps: tuple[bytes, bytes] | None  # uid_map, gid_map for a user namespace
    cap_last: int
    max_fd: int
    libc: ctypes.CDLL = field(repr=False)
    workspace: Callable[[], str] | None = field(default=None, repr=False)
    home_fd: int = -1  # `home` as it was before the veil covered it (set by the init)


def setup_error(returncode: int, stderr: bytes | bytearray) -> str | None:
    """What went wrong setting a sandbox up, as its processes reported it; None if nothing."""
    if returncode == FAILED and stderr.startswith(PREFIX):
        return stderr[len(PREFIX):].decode(errors="replace").strip()
    return None


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def plan(isolation: Isolation,
         workspace: Callable[[], Path] | None = None) -> Callable[[], None]:
    """The isolation part of a `preexec_fn`: returns in the tool process only.

    `workspace`, if given, is called in the tool process once the sandbox is set up but for
    the workspace, and returns the directory to bind writable instead of `isolation.writable`
    (a sibling of it: same parent). A warm runner's spare learns its call's workspace then."""
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if isolation.network:
        flags |= CLONE_NEWNET
    maps = None
    if os.geteuid() != 0:  # an unprivileged worker needs a user namespace to do the rest
        flags |= CLONE_NEWUSER
        uid, gid = os.geteuid(), os.getegid()
        maps = (f"{uid} {uid} 1".encode(), f"{gid} {gid} 1".encode())
    try:
        cap_last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        cap_last = 40
    user = isolation.user if os.geteuid() == 0 else None
    writable = str(isolation.writable.resolve())
    shown = veils(isolation, user)
    holding = [(target, kept) for target, kept in mount_points()
               if writable == target or writable.startswith(target.rstrip("/") + "/")]
    p = _Plan(flags=flags, writable=writable,
              veils=[(d, [path for path in paths if path != writable]) for d, paths in shown],
              home=next((d for d, paths in shown if writable in paths), None),
              writable_flags=max(holding, key=lambda m: len(m[0]))[1] if holding else 0,
              user=user, maps=maps,
              cap_last=cap_last, max_fd=os.sysconf("SC_OPEN_MAX"), libc=_libc(),
              workspace=None if workspace is None else lambda: str(workspace().resolve()))
    return lambda: _relay(p)


def veils(isolation: Isolation, user: tuple[int, int] | None) -> list[tuple[str, list[str]]]:
    """The directories to show empty, outermost first, each with the paths bound back in it:
    `hide` keeps `writable`; for a `user`, the first directory above a needed path that is
    closed to others keeps that path."""
    hidden: dict[str, set[str]] = {}
    if isolation.hide is not None:
        hidden[str(isolation.hide)] = set()
    # a path that does not exist needs no binding (a missing command fails as it would)
    needed = [isolation.writable, *(p for p in isolation.readable if p.exists())]
    for path in (p.resolve() for p in needed):
        closed = _closed_ancestor(path) if user is not None else None
        if closed is not None:
            hidden.setdefault(str(closed), set())
    for path in (str(p.resolve()) for p in needed):
        homes = [d for d in hidden if path.startswith(d.rstrip("/") + "/")]
        if homes:  # bound back by the innermost hidden directory above it
            hidden[max(homes, key=len)].add(path)
    ordered = sorted(hidden, key=lambda d: (d.count("/"), d))
    return [(d, _outermost(hidden[d])) for d in ordered]


def _outermost(paths: set[str]) -> list[str]:
    """Drop paths inside other paths of the set (binding the outer one brings them along)."""
    keep = sorted(paths, key=len)
    return [p for i, p in enumerate(keep)
            if not any(p.startswith(q.rstrip("/") + "/") for q in keep[:i])]


def _closed_ancestor(path: Path) -> Path | None:
    """The outermost directory above `path` that other users cannot search."""
    for parent in reversed(path.parents):
        try:
            if not parent.stat().st_mode & 0o001:
                return parent
        except OSError:
            return None
    return None


def fail(what: str, err: int | None = None) -> NoReturn:
    """Report a set-up failure on stderr and end this process (never returns)."""
    detail = f": {os.strerror(err)}" if err else ""
    try:
        os.write(2, PREFIX + f"{what}{detail}\n".encode())
    finally:
        os._exit(FAILED)


def _check(result: int, what: str) -> None:
    if result != 0:
        fail(what, ctypes.get_errno())


def _fork(what: str) -> int:
    try:
        return os.fork()
    except OSError as exc:
        fail(what, exc.errno)


_RESET = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
          signal.SIGUSR2)


def _relay(p: _Plan) -> None:
    """The process subprocess forked: new namespaces, then wait for the init and exit alike."""
    for sig in _RESET:  # the worker's Python handlers must not run in the sandbox's processes
        signal.signal(sig, signal.SIG_DFL)
    _check(p.libc.unshare(p.flags), "cannot create namespaces (unshare)")
    if p.maps is not None:
        _write("/proc/self/setgroups", b"deny")
        _write("/proc/self/uid_map", p.maps[0])
        _write("/proc/self/gid_map", p.maps[1])
    read_end, write_end = os.pipe()
    if _fork("cannot start the sandbox init") == 0:
        os.close(read_end)
        _init(p, write_end)
        return  # in the tool process
    os.close(write_end)
    _close_all_but(read_end, p.max_fd)
    # the init reports the tool's status before it exits: the relay need not wait for the
    # kernel to tear the namespaces down (the caller kills the group, init included, next)
    reported = os.read(read_end, 8)
    if len(reported) == 8:
        _exit_like(int.from_bytes(reported, "little", signed=True))
    _, status = _wait_for(-1)  # the init failed before it could report
    _exit_like(status)


def _init(p: _Plan, report: int) -> None:
    """PID 1 of the sandbox: set up the filesystem, start the tool, reap until it exits."""
    try:
        _mounts(p)
    except OSError as exc:
        fail(f"cannot set up the filesystem ({exc.filename or ''})", exc.errno)
    tool = _fork("cannot start the tool process")
    if tool == 0:
        os.close(report)
        workspace = p.writable if p.workspace is None else p.workspace()
        if os.path.dirname(workspace) != os.path.dirname(p.writable):
            fail(f"workspace {workspace} is not beside {p.writable}")
        try:
            _bind_workspace(p, workspace)
        except OSError as exc:
            fail(f"cannot mount the workspace ({exc.filename or ''})", exc.errno)
        _become_tool(p, workspace)
        return
    _close_all_but(report, p.max_fd)
    while True:
        pid, status = _wait_for(-1)
        if pid == tool:
            break
    os.write(report, status.to_bytes(8, "little", signed=True))
    os._exit(0)  # the kernel now kills whatever is left in the namespace


def _become_tool(p: _Plan, workspace: str) -> None:
    os.chdir(workspace)  # the bind mount, not the read-only directory beneath it
    if p.user is not None:
        uid, gid = p.user
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)  # leaving uid 0 clears every capability
    else:
        for cap in range(p.cap_last + 1):
            p.libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # exec cannot give them back
        header = _CapHeader(_CAP_VERSION_3, 0)
        data = (_Cap * 2)()
        _check(p.libc.capset(ctypes.byref(header), data), "cannot drop capabilities")
    _check(p.libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "cannot set no_new_privs")


def _mount(p: _Plan, source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    if p.libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


def _mounts(p: _Plan) -> None:
    """Everything but the workspace: veils, a fresh /proc, every mount read-only."""
    def call(source: str | None, target: str, fstype: str | None, flags: int,
             data: str | None = None) -> None:
        _mount(p, source, target, fstype, flags, data)

    call(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the host
    kept = {path: os.open(path, os.O_PATH) for _, paths in p.veils for path in paths}
    if p.home is not None:  # the tool process binds the workspace from here, once veiled
        p.home_fd = os.open(p.home, os.O_PATH | os.O_CLOEXEC)
    for directory, paths in p.veils:
        os.makedirs(directory, exist_ok=True)
        call("tmpfs", directory, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
        for path in paths:
            if os.path.isdir(f"/proc/self/fd/{kept[path]}"):
                os.makedirs(path, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
            call(f"/proc/self/fd/{kept[path]}", path, None, MS_BIND | MS_REC)
    for fd in kept.values():
        os.close(fd)
    call("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for target, flags in mount_points():
        if target.startswith("/proc/"):
            continue  # the fresh /proc has no submounts: these lie under it, out of reach
        try:
            call(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
        except OSError as exc:
            # a mount point that is no longer reachable (covered by a later mount) is fine;
            # anything else would leave something writable
            if exc.errno not in (errno.ENOENT, errno.EACCES) or target == "/":
                raise


def _bind_workspace(p: _Plan, workspace: str) -> None:
    """Mount the workspace read-write, the last mount: in its veil (writable for the moment
    it takes to make the mount point), or over itself."""
    veil = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV
    source = workspace
    if p.home is not None:
        source = f"/proc/self/fd/{p.home_fd}/{os.path.relpath(workspace, p.home)}"
        _mount(p, None, p.home, None, veil)
        os.makedirs(workspace, exist_ok=True)
    _mount(p, source, workspace, None, MS_BIND | MS_REC)
    _mount(p, None, workspace, None, MS_REMOUNT | MS_BIND | p.writable_flags)
    if p.home is not None:
        _mount(p, None, p.home, None, veil | MS_RDONLY)


def mount_points(mountinfo: str = "/proc/self/mountinfo") -> list[tuple[str, int]]:
    """(mount point, per-mount flags to keep) for every mount, in mount order."""
    points = []
    with open(mountinfo, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            target = _unescape(fields[4])
            flags = 0
            for option in fields[5].split(","):
                flags |= _KEPT_FLAGS.get(option, 0)
            points.append((target, flags))
    return points


def _unescape(text: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (`\\040`)."""
    if "\\" not in text:
        return text
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and text[i + 1:i + 4].isdigit():
            out.append(chr(int(text[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _b(text: str | None) -> bytes | None:
    return None if text is None else os.fsencode(text)


def _write(path: str, data: bytes) -> None:
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    except OSError as exc:
        fail(f"cannot write {path}", exc.errno)


def _close_all_but(keep: int, max_fd: int) -> None:
    os.closerange(0, keep)
    os.closerange(keep + 1, max_fd)


def _wait_for(pid: int) -> tuple[int, int]:
    while True:
        try:
            return os.waitpid(pid, 0)
        except InterruptedError:
            continue
        except ChildProcessError:
            return -1, 0


def _exit_like(status: int) -> None:
    """End this process the way a child with wait status `status` ended (never returns)."""
    try:
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            if sig not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
            os._exit(128 + sig)
        os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else FAILED)
    finally:
        os._exit(FAILED)


# ---------------------------------------------------------------- what this machine allows


@cache
def unavailable_reason() -> str | None:
    """Why namespaces cannot isolate sandboxes here (None: they can). Probed once per process:
    `/bin/sh -c 'exit 0'` started through `plan` alone, as `run_sandboxed` would start it."""
    probe = Path(f"/tmp/cortex-sandbox-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", "exit 0"], cwd=probe, env={"PATH": "/usr/bin:/bin"},
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True, close_fds=True, preexec_fn=plan(Isolation(writable=probe)))
        try:
            _, stderr = proc.communicate(timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # not reaped yet: the group id is still its own
            proc.wait()
            return f"the probe did not finish within {PROBE_TIMEOUT_S} s"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot start the probe: {exc}"
    finally:
        probe.rmdir()
    if (reason := setup_error(proc.returncode, stderr)) is not None:
        return reason
    if proc.returncode != 0:
        return f"the probe exited with status {proc.returncode}"
    return None


@cache
def sandbox_user(name: str | None) -> tuple[int, int] | None:
    """(uid, gid) of user `name` for a root worker; None to keep the worker's own uid.
    Looked up once per process: every tool call asks."""
    if not name or os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return None
    return None if entry.pw_uid == 0 else (entry.pw_uid, entry.pw_gid)


@cache
def interpreter_paths() -> tuple[Path, ...]:
    """What a python tool needs to read: the interpreter, its prefixes and this package."""
    return (Path(sys.executable), Path(sys.prefix), Path(sys.base_prefix),
            Path(__file__).resolve().parents[1])
