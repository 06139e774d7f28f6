"""Tests of the integration harness itself: Redis, process groups, leak guards, readiness."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
import redis

from tests import harness

pytestmark = pytest.mark.integration

LINUX_ONLY = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


def _pid_gone(pid: int) -> bool:
    """`pid` has exited (a zombie counts as gone: it runs no more)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    return state in ("Z", "X")


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except ConnectionRefusedError:
        return True
    return False


# --------------------------------------------------------------------------- helpers


def test_free_port_is_bindable() -> None:
    port = harness.free_port()
    assert 1024 < port < 65536 and port != 6379
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_wait_until_returns_value_and_times_out() -> None:
    calls = iter([0, None, "done"])
    assert harness.wait_until(lambda: next(calls), timeout=1, interval=0) == "done"
    # the condition never holds: only its timeout ends the wait, with the message given, or
    # else one naming the timeout
    with pytest.raises(TimeoutError, match=r"^never$"):
        harness.wait_until(lambda: False, timeout=0.1, interval=0.01, message="never")
    with pytest.raises(TimeoutError, match=r"^condition not met within 0\.1s: "):
        harness.wait_until(lambda: False, timeout=0.1, interval=0.01)


# --------------------------------------------------------------------------- Redis


def test_redis_server_starts_on_private_port() -> None:
    with harness.RedisServer() as server:
        assert server.port != 6379
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        client = server.client(decode_responses=True)
        assert client.ping()
        assert int(client.info("server")["tcp_port"]) == server.port
        assert client.config_get("appendonly") == {"appendonly": "no"}
        assert client.config_get("save") == {"save": ""}
        assert Path(client.config_get("dir")["dir"]).resolve() == server.data_dir.resolve()
        client.close()
        data_dir = server.data_dir
    assert not data_dir.exists(), "close() removes the temp data dir"


def test_restart_with_aof_keeps_data() -> None:
    with harness.RedisServer(appendonly=True) as server:
        port = server.port
        client = server.client(decode_responses=True)
        client.set("kept", "yes")
        client.rpush("list", "a", "b")
        server.restart()
        assert server.port == port
        assert client.get("kept") == "yes"  # the client reconnects on its own
        assert client.lrange("list", 0, -1) == ["a", "b"]
        client.close()


def test_restart_without_aof_starts_empty() -> None:
    with harness.RedisServer() as server:
        client = server.client()
        client.set("lost", "1")
        server.restart()
        assert client.get("lost") is None
        client.close()


def test_stop_frees_port_and_kills_group() -> None:
    server = harness.RedisServer()
    try:
        server.start()
        port, proc = server.port, server.process
        assert proc is not None and proc.members()
        server.stop()
        assert not proc.alive and proc.members() == []
        assert proc not in harness.live_processes()
        assert _refused(port)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
        server.start()  # and it comes back on the same port
        assert server.port == port and server.client().ping()
    finally:
        server.close()


def test_failed_start_raises_with_log_tail(tmp_path: Path) -> None:
    server = harness.RedisServer(extra_args=["--no-such-directive", "1"], log_dir=tmp_path)
    with pytest.raises(harness.HarnessError, match="no-such-directive") as info:
        server.start()
    assert "exited with" in str(info.value)
    assert server.process is not None and server.process not in harness.live_processes()
    server.close()


def test_session_redis_fixture(redis_server: harness.RedisServer, cortex_env: dict[str, str],
                               clean_redis: redis.Redis) -> None:
    assert cortex_env["CORTEX_REDIS_URL"] == redis_server.url
    assert ":6379" not in redis_server.url
    assert Path(cortex_env["CORTEX_WORKSPACE_ROOT"]).is_dir()
    assert cortex_env["CORTEX_MANIFESTS"].endswith(os.path.join("tests", "manifests"))
    assert "CORTEX_BROKER_URL" not in cortex_env
    # empty, but for what the session's live workers write at any moment (their heartbeats,
    # the reconciler's lock, kombu's own keys): a run with a CPU hog saw two such keys
    # written between the flush and the look
    live = ("cx:alive:", "cx:reconciler", "_kombu.", "unacked")
    assert [k for k in clean_redis.keys("*") if not k.startswith(live)] == []
    clean_redis.set("k", "v")
    assert clean_redis.get("k") == "v"


# --------------------------------------------------------------------------- processes


def test_process_tail_and_group_kill(tmp_path: Path) -> None:
    script = "for i in 1 2 3 4 5; do echo line$i; done; sleep 60 & sleep 60 & wait"
    proc = harness.Process(["sh", "-c", script], name="sh-test", log_dir=tmp_path)
    try:
        harness.wait_until(lambda: "line5" in proc.tail(), timeout=5)
        harness.wait_until(lambda: len(proc.members()) == 3, timeout=5)
        assert proc.tail(2).splitlines() == ["line4", "line5"]
        assert proc.log_path.parent == tmp_path
        proc.kill(signal.SIGTERM)
        assert proc.wait_stopped(5)
        assert proc.members() == []
    finally:
        proc.stop()
    assert proc.returncode is not None


def test_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready-' + str(6 * 7), flush=True); time.sleep(60)")
    proc = harness.Process([sys.executable, "-c", code], log_dir=tmp_path)
    harness.wait_until(lambda: "ready-42" in proc.tail(), timeout=5)
    proc.stop(timeout=0.3)
    # killed, not left to its minute's sleep (after which it would have exited 0): it ignores
    # SIGTERM, so SIGKILL, sent when the 0.3 s were over, is what ended it
    assert proc.returncode == -signal.SIGKILL
    assert proc.members() == []


def test_missing_executable_is_reported() -> None:
    with pytest.raises(harness.HarnessError, match="not found"):
        harness.Process(["no-such-cortex-binary-xyz"])


@LINUX_ONLY
def test_children_die_with_the_test_process(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG: a harness child dies when the process that started it is SIGKILLed."""
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from tests.harness import Process
        p = Process(["sleep", "60"], log_dir={str(tmp_path)!r})
        print(p.pid, flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert not _pid_gone(child)
        parent.kill()
        parent.wait(5)
        harness.wait_until(lambda: _pid_gone(child), timeout=5)
    finally:
        parent.kill()
        parent.wait(5)


@LINUX_ONLY
def test_reap_orphans_kills_leftovers_of_dead_runs() -> None:
    env = dict(os.environ, **{harness.OWNER_ENV: "999999999:0"})  # an owner that never ran
    orphan = subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)
    try:
        harness.wait_until(lambda: harness.OWNER_ENV in harness._proc_environ(orphan.pid),
                           timeout=5)
        mine = harness.Process(["sleep", "60"])  # alive owner: must survive
        try:
            killed = harness.reap_orphans()
            assert orphan.pid in killed and mine.pid not in killed
            assert orphan.wait(5) == -signal.SIGKILL
            assert mine.alive
        finally:
            mine.stop()
    finally:
        orphan.kill()
        orphan.wait(5)


@LINUX_ONLY
def test_reap_orphans_kills_registered_groups_of_dead_runs() -> None:
    """A leader whose environment says nothing (redis-server overwrites it) is found through
    the registry, together with its group."""
    orphan = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"], env={"PATH": os.defpath},
                              start_new_session=True)
    record = harness._registry_dir() / f"test-{orphan.pid}.json"
    try:
        harness.wait_until(lambda: len(_group(orphan.pid)) == 3, timeout=5)
        record.parent.mkdir(mode=0o700, exist_ok=True)
        record.write_text(json.dumps({"owner": "999999999:0", "pgid": orphan.pid,
                                      "start": harness._proc_start_time(orphan.pid)}))
        killed = harness.reap_orphans()
        assert set(_group(orphan.pid)) <= set(killed)
        assert orphan.wait(5) == -signal.SIGKILL
        assert not record.exists()
        harness.wait_until(lambda: not _group(orphan.pid), timeout=5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(orphan.pid, signal.SIGKILL)
        orphan.wait(5)
        record.unlink(missing_ok=True)


def _group(pgid: int) -> list[int]:
    """Running members of process group `pgid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            info = harness._proc_pgrp_state(int(entry.name))
            if info is not None and info[0] == pgid and info[1] not in ("Z", "X"):
                found.append(int(entry.name))
    return found


# --------------------------------------------------------------------------- Celery readiness


def test_ping_readiness_with_a_plain_celery_worker(redis_server: harness.RedisServer,
                                                   tmp_path: Path) -> None:
    """The readiness check used by `start_workers`, against a bare `celery worker`."""
    env = {"CORTEX_REDIS_URL": redis_server.url}
    args = [str(Path(sys.executable).parent / "celery"), "-b", redis_server.url, "worker",
            "--pool", "solo", "-n", "harness-test@%h", "--without-mingle", "--without-gossip",
            "--without-heartbeat", "-l", "info"]
    proc = harness.Process(args, name="celery-plain", log_dir=tmp_path, cwd=tmp_path)
    try:
        harness.wait_workers_ready([proc], env, timeout=30)
        assert proc.worker_hostname is not None
        assert proc.worker_hostname.startswith("harness-test@")
    finally:
        proc.stop(timeout=10)
    assert proc.members() == []


def test_readiness_reports_a_worker_that_exits(redis_server: harness.RedisServer,
                                               tmp_path: Path) -> None:
    proc = harness.Process(["sh", "-c", "echo boom >&2; exit 3"], name="bad-worker",
                           log_dir=tmp_path)
    with pytest.raises(harness.HarnessError, match="boom"):
        harness.wait_workers_ready([proc], {"CORTEX_REDIS_URL": redis_server.url}, timeout=10)
    proc.stop()


# --------------------------------------------------------------------------- HTTP readiness

ASGI_APP = """
from fastapi import FastAPI
from fastapi.responses import JSONResponse

app = FastAPI()

@app.get("/healthz")
def healthz():
    return JSONResponse({"ok": True})
"""


def test_start_api_with_a_plain_uvicorn_app(tmp_path: Path) -> None:
    """`start_api`'s start, readiness and stop, with uvicorn serving a stand-in app."""
    (tmp_path / "stand_in_api.py").write_text(ASGI_APP)
    command = [sys.executable, "-m", "uvicorn", "--app-dir", str(tmp_path), "stand_in_api:app"]
    proc = harness.start_api(dict(os.environ), command=command, log_dir=tmp_path, cwd=tmp_path)
    try:
        assert proc.url == f"http://127.0.0.1:{proc.port}"
        assert httpx.get(f"{proc.url}/healthz", timeout=5).json() == {"ok": True}
    finally:
        proc.stop()
    assert proc.members() == [] and proc.port is not None and _refused(proc.port)


def test_start_api_reports_a_server_that_exits(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "import sys; print('no app here', file=sys.stderr); sys.exit(2)"]
    with pytest.raises(harness.HarnessError, match="no app here"):
        harness.start_api(dict(os.environ), command=command, log_dir=tmp_path, timeout=10)


# --------------------------------------------------------------------------- the engine fixtures


def test_workers_fixture(workers: dict[str, harness.Process]) -> None:
    from tests.integration.conftest import WORKER_POOLS

    assert list(workers) == WORKER_POOLS
    for pool, proc in workers.items():
        assert proc.alive and proc.pool == pool and proc.worker_hostname


def test_api_fixture(api: harness.Process) -> None:
    assert api.url is not None and api.port is not None
    assert httpx.get(f"{api.url}/healthz", timeout=5).status_code == 200
