"""A private Docker daemon for the tests, and a test image built locally (nothing is pulled).

* `start_dockerd(tmp_root)` -> `DockerDaemon`, or raises `DockerdUnavailable(reason)`;
  `ensure_dockerd(tmp_root)` -> `DockerDaemon | None` (the reason printed to stderr and kept in
  `last_reason`).
* Needs root on Linux. Installs what is missing with apt (Debian's `docker.io` for dockerd,
  `busybox-static` for the image), `apt-get update` first only if the install fails; a no-op
  when both are present.
* The daemon is ours alone: its own `--data-root` (under `tmp_root`), `--exec-root`, pidfile,
  socket and config file (empty: the machine's /etc/docker/daemon.json is not read), its own
  containerd namespace, `--bridge=none --iptables=false --ip6tables=false`: no bridge
  network is created and the firewall is not touched, so containers have either no network
  or the host's. It runs as a `harness.Process` (own process group, stopped at exit, reaped by
  `harness.reap_orphans` if a test run dies).
* `DockerDaemon.build_test_image()` builds `TEST_IMAGE` FROM scratch: the static busybox and a
  symlink per applet in /bin (sh, echo, cat, sleep, wc, wget, nc, ...).
* `DockerDaemon.timings`: seconds spent installing, starting and building.

`python -m tests.dockerd` starts a daemon, builds the image, stops it and prints the timings.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests import harness

__all__ = [
    "BUSYBOX",
    "TEST_IMAGE",
    "DockerDaemon",
    "DockerdUnavailable",
    "ensure_dockerd",
    "start_dockerd",
]

TEST_IMAGE = "cortex-test/busybox:1"
BUSYBOX = Path("/bin/busybox")
SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
APT_TIMEOUT_S = 600
START_TIMEOUT_S = 60
NAMESPACE = "cortex-test"

last_reason: str | None = None
"""Why the last `ensure_dockerd` returned None."""


class DockerdUnavailable(RuntimeError):
    """dockerd cannot run here; the message says why."""


# --------------------------------------------------------------------------- installing


def _path() -> str:
    return os.pathsep.join(p for p in [os.environ.get("PATH", ""), SBIN_PATH] if p)


def _which(name: str) -> str | None:
    return shutil.which(name, path=_path())


def _apt(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "PATH": _path()}
    return subprocess.run(["apt-get", *args], env=env, capture_output=True, text=True,
                          timeout=APT_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False)


def apt_install(packages: list[str]) -> None:
    """`apt-get install -y --no-install-recommends`, after `apt-get update` if it fails."""
    if _which("apt-get") is None:
        raise DockerdUnavailable(f"{' and '.join(packages)} missing and there is no apt-get")
    install = ("install", "-y", "--no-install-recommends", *packages)
    try:
        done = _apt(*install)
        if done.returncode != 0:  # most often: no package lists yet
            _apt("update")
            done = _apt(*install)
    except subprocess.TimeoutExpired:
        raise DockerdUnavailable(f"apt-get install {' '.join(packages)} took over "
                                 f"{APT_TIMEOUT_S}s") from None
    if done.returncode != 0:
        output = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
        raise DockerdUnavailable(f"apt-get install {' '.join(packages)} failed "
                                 f"(exit {done.returncode}):\n{output}")


def ensure_packages() -> float:
    """Install dockerd and busybox if missing; returns the seconds spent (0 if none)."""
    missing = []
    if _which("dockerd") is None:
        missing.append("docker.io")
    if not BUSYBOX.is_file():
        missing.append("busybox-static")
    if not missing:
        return 0.0
    started = time.monotonic()
    apt_install(missing)
    if _which("dockerd") is None:
        raise DockerdUnavailable("docker.io is installed but there is no dockerd on PATH")
    if not BUSYBOX.is_file():
        raise DockerdUnavailable(f"busybox-static is installed but there is no {BUSYBOX}")
    return time.monotonic() - started


# --------------------------------------------------------------------------- the daemon


@dataclass
class DockerDaemon:
    """A running private dockerd; `host` is its DOCKER_HOST (`unix:///.../docker.sock`)."""

    process: harness.Process
    data_root: Path
    run_dir: Path
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def socket(self) -> Path:
        return self.run_dir / "docker.sock"

    @property
    def host(self) -> str:
        return f"unix://{self.socket}"

    @property
    def exec_root(self) -> Path:
        return self.run_dir / "exec"

    def client(self, timeout: float = 30.0) -> Any:
        """A docker SDK client of this daemon (close it)."""
        import docker

        return docker.DockerClient(base_url=self.host, timeout=timeout)

    def ping(self) -> bool:
        if not self.socket.exists():
            return False
        try:
            client = self.client(timeout=2.0)
        except Exception:
            return False
        try:
            return bool(client.ping())
        except Exception:
            return False
        finally:
            client.close()

    def build_test_image(self, tag: str = TEST_IMAGE) -> str:
        """Build `tag` FROM scratch with the static busybox (skipped if present); its id."""
        import docker

        started = time.monotonic()
        client = self.client(timeout=120.0)
        try:
            with contextlib.suppress(docker.errors.ImageNotFound):
                return client.images.get(tag).id
            image, _ = client.images.build(fileobj=_busybox_context(), custom_context=True,
                                           tag=tag, rm=True, forcerm=True, pull=False)
            return image.id
        finally:
            client.close()
            self.timings["image"] = self.timings.get("image", 0.0) + time.monotonic() - started

    def containers(self, **filters: str) -> list[Any]:
        """Containers (running or not) matching label filters, e.g. `{"label": "k=v"}`. One
        removed while they are listed is left out: the SDK's `list` inspects each container
        after listing them all, and a removal in between raised `NotFound` (a flaky test)."""
        import docker

        client = self.client()
        try:
            found = []
            for listed in client.containers.list(all=True, filters=dict(filters), sparse=True):
                with contextlib.suppress(docker.errors.NotFound):
                    found.append(client.containers.get(listed.id))
            return found
        finally:
            client.close()

    def stop(self) -> None:
        """Stop dockerd (it stops its containers and containerd), then clean up after it."""
        with contextlib.suppress(harness.HarnessError):
            self.process.stop(timeout=30.0)
        containerd_pid = _read_pid(self.exec_root / "containerd" / "containerd.pid")
        if containerd_pid and str(self.exec_root).encode() in _cmdline(containerd_pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(containerd_pid, signal.SIGKILL)
        leftover = _unmount_under(self.run_dir) + _unmount_under(self.data_root)
        if not leftover:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            shutil.rmtree(self.data_root, ignore_errors=True)


def start_dockerd(tmp_root: str | os.PathLike[str]) -> DockerDaemon:
    """Install what is missing, start a private dockerd, wait until it answers. Raises
    `DockerdUnavailable` with the reason when it cannot run here."""
    if not sys.platform.startswith("linux"):
        raise DockerdUnavailable(f"dockerd runs on Linux only (this is {sys.platform})")
    if os.geteuid() != 0:
        raise DockerdUnavailable(f"starting a private dockerd needs root (running as uid "
                                 f"{os.geteuid()})")
    try:
        import docker  # noqa: F401
    except ImportError:
        raise DockerdUnavailable("the docker SDK is not installed (pip install 'docker>=7')") \
            from None
    timings = {"install": ensure_packages()}
    dockerd = _which("dockerd")
    assert dockerd is not None
    data_root = Path(tmp_root).resolve() / "docker-data"
    data_root.mkdir(parents=True, exist_ok=True)
    # Unix socket paths are limited to 108 bytes: keep the socket and exec-root short.
    run_dir = Path(tempfile.mkdtemp(prefix="cxd-", dir="/tmp"))
    (run_dir / "daemon.json").write_text(json.dumps({}))
    args = [
        dockerd,
        "--config-file", str(run_dir / "daemon.json"),
        "--data-root", str(data_root),
        "--exec-root", str(run_dir / "exec"),
        "--pidfile", str(run_dir / "docker.pid"),
        "-H", f"unix://{run_dir / 'docker.sock'}",
        "--containerd-namespace", NAMESPACE,
        "--containerd-plugins-namespace", f"{NAMESPACE}-plugins",
        "--bridge=none",
        "--iptables=false",
        "--ip6tables=false",
        "--ip-masq=false",
        "--userland-proxy=false",
        "--shutdown-timeout=2",
        "--log-level=warn",
    ]  # fmt: skip
    env = {**os.environ, "PATH": _path()}
    env.pop("DOCKER_HOST", None)
    started = time.monotonic()
    process = harness.Process(args, name="dockerd", env=env, cwd=run_dir, log_dir=tmp_root)
    daemon = DockerDaemon(process=process, data_root=data_root, run_dir=run_dir,
                          timings=timings)

    def ready() -> bool:
        if not process.alive:
            raise DockerdUnavailable(f"dockerd exited with {process.returncode} at start-up:\n"
                                     f"{process.tail(20)}")
        return daemon.ping()

    try:
        harness.wait_until(ready, timeout=START_TIMEOUT_S, interval=0.1)
    except TimeoutError:
        tail = process.tail(20)
        daemon.stop()
        raise DockerdUnavailable(f"dockerd did not answer within {START_TIMEOUT_S}s:\n{tail}") \
            from None
    except BaseException:
        daemon.stop()
        raise
    timings["start"] = time.monotonic() - started
    return daemon


def ensure_dockerd(tmp_root: str | os.PathLike[str]) -> DockerDaemon | None:
    """`start_dockerd`, or None when it cannot run here (reason on stderr, in `last_reason`)."""
    global last_reason
    try:
        daemon = start_dockerd(tmp_root)
    except DockerdUnavailable as exc:
        last_reason = str(exc)
        print(f"dockerd unavailable: {exc}", file=sys.stderr)
        return None
    last_reason = None
    return daemon


# --------------------------------------------------------------------------- helpers


def _busybox_context() -> io.BytesIO:
    """A build context: Dockerfile + rootfs/bin/busybox and one symlink per applet."""
    applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    dockerfile = b'FROM scratch\nCOPY rootfs/ /\nENV PATH=/bin\nCMD ["sh"]\n'
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        _add_file(tar, "Dockerfile", dockerfile, 0o644)
        for name in ("rootfs", "rootfs/bin", "rootfs/tmp", "rootfs/workspace"):
            info = tarfile.TarInfo(name)
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if name.endswith("tmp") else 0o755
            tar.addfile(info)
        _add_file(tar, "rootfs/bin/busybox", BUSYBOX.read_bytes(), 0o755)
        for applet in sorted(set(applets) - {"busybox"}):
            if "/" in applet or applet.startswith("."):
                continue
            info = tarfile.TarInfo(f"rootfs/bin/{applet}")
            info.type = tarfile.SYMTYPE
            info.linkname = "busybox"
            tar.addfile(info)
    buffer.seek(0)
    return buffer


def _add_file(tar: tarfile.TarFile, name: str, data: bytes, mode: int) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    tar.addfile(info, io.BytesIO(data))


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _unmount_under(root: Path) -> list[str]:
    """Lazily unmount whatever is still mounted under `root`; returns what stays mounted."""
    def mounted() -> list[str]:
        try:
            lines = Path("/proc/self/mounts").read_text().splitlines()
        except OSError:
            return []
        points = [line.split()[1].encode().decode("unicode_escape") for line in lines]
        prefix = str(root)
        return [p for p in points if p == prefix or p.startswith(prefix + "/")]

    for point in sorted(mounted(), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)
    return mounted()


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="cortex-dockerd-"))
    started = time.monotonic()
    daemon = ensure_dockerd(root)
    if daemon is None:
        print(f"unavailable: {last_reason}")
        return 1
    try:
        daemon.build_test_image()
        total = time.monotonic() - started
        print(json.dumps({**{k: round(v, 2) for k, v in daemon.timings.items()},
                          "total": round(total, 2)}))
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
