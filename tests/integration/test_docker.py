"""Docker tools end to end: API → `docker` queue → a docker pool worker → a container on a
private dockerd (tests/dockerd.py) running the locally built busybox image.

Skipped, with the reason, where a private dockerd cannot run (not root, no apt, no kernel
support). The daemon has no bridge network (`--bridge=none`): containers have either no network
or the host's, and the only traffic sent is to a loopback server of this test.
"""

from __future__ import annotations

import dataclasses
import http.server
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cortex_worker.sandbox import docker as sandbox_docker
from cortex_worker.settings import Settings
from cortex_worker.tools.attempt import ENV as ATTEMPT_ENV
from cortex_worker.tools.context import ToolContext
from cortex_worker.tools.errors import ToolError, ToolTimeout
from cortex_worker.tools.runtime import run_tool
from cortex_worker.tools.spec import ToolSpec
from tests import harness
from tests.dockerd import TEST_IMAGE, DockerDaemon, DockerdUnavailable, start_dockerd
from tests.integration.test_documents import action, follow, of, one, run, submit

MIB = 1024 * 1024


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def dockerd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DockerDaemon]:
    """A private dockerd with the test image built; skips the module if it cannot run."""
    try:
        daemon = start_dockerd(tmp_path_factory.mktemp("dockerd"))
    except DockerdUnavailable as exc:
        pytest.skip(f"cannot run a private dockerd here: {exc}")
    try:
        daemon.build_test_image()
        print(f"dockerd timings (s): {daemon.timings}")
        yield daemon
    finally:
        daemon.stop()


@pytest.fixture(scope="module")
def docker_worker(dockerd: DockerDaemon, cortex_env: dict[str, str],
                  harness_dir: Path) -> Iterator[harness.Process]:
    """A `cortex worker --pool docker` talking to the private dockerd (through DOCKER_HOST)."""
    env = {**cortex_env, "DOCKER_HOST": dockerd.host}
    proc = harness.start_worker("docker", env, concurrency=2, log_dir=harness_dir,
                                cwd=harness_dir)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def api(workers: Any, docker_worker: harness.Process, api: Any) -> Any:
    return api


@pytest.fixture
def settings(dockerd: DockerDaemon, tmp_path: Path) -> Settings:
    """Settings of an in-process caller of the sandbox (CORTEX_DOCKER_HOST = the daemon)."""
    return Settings(docker_host=dockerd.host, workspace_root=tmp_path / "workspaces")


@pytest.fixture
def loopback_server() -> Iterator[tuple[int, list[str]]]:
    """An HTTP server on 127.0.0.1 answering "pong": (its port, the paths it was asked)."""
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            body = b"pong"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer((harness.LOOPBACK, 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], hits
    finally:
        server.shutdown()
        server.server_close()


def workspace_of(cortex_env: dict[str, str], job_id: str) -> Path:
    return Path(cortex_env["CORTEX_WORKSPACE_ROOT"]) / job_id


def job_containers(dockerd: DockerDaemon, job_id: str) -> list[Any]:
    return dockerd.containers(label=f"{sandbox_docker.LABEL_JOB}={job_id}")


def wait_job_container(api: Any, dockerd: DockerDaemon, job_id: str) -> Any:
    def found() -> Any:
        containers = job_containers(dockerd, job_id)
        return containers[0] if containers else None

    return harness.wait_until(found, timeout=20, interval=0.1,
                              message=f"no container of job {job_id} appeared")


# --------------------------------------------------------------------------- end to end


def test_container_output_is_the_result(api: Any) -> None:
    _, events = run(api, action("hi", "box_echo", {"message": "hello from a box"}))
    assert one(events, "action_completed", "hi")["data"]["result"] == {
        "exit_code": 0, "stdout": "hello from a box\n", "stderr": ""}
    assert events[-1]["type"] == "job_completed"


def test_workspace_is_mounted_read_write(api: Any, cortex_env: dict[str, str]) -> None:
    doc = (action("note", "write_file", {"path": "notes.txt", "content": "one two three four"})
           + action("count", "box_wc", {"path": "notes.txt"}, depends_on=["note"])
           + action("out", "box_sh", {"script": "echo made in a box > /workspace/out.txt"}))
    job_id, events = run(api, doc)
    assert events[-1]["type"] == "job_completed", events[-1]
    assert one(events, "action_completed", "count")["data"]["result"]["stdout"] == \
        "4 notes.txt\n"
    workspace = workspace_of(cortex_env, job_id)
    out = workspace / "out.txt"
    assert out.read_text() == "made in a box\n"
    # the container runs as the workspace's owner (the sandbox user python/shell tools use)
    assert (out.stat().st_uid, out.stat().st_gid) == (workspace.stat().st_uid,
                                                      workspace.stat().st_gid)


def test_read_only_root_no_capabilities_and_only_the_manifest_env(api: Any) -> None:
    script = ("touch /root-file || echo ROOT_RO; echo x > /workspace/w && echo WS_OK; "
              "echo x > /tmp/t && echo TMP_OK; grep CapEff /proc/self/status; pwd; env")
    _, events = run(api, action("box", "box_sh", {"script": script}))
    result = one(events, "action_completed", "box")["data"]["result"]
    out = result["stdout"]
    assert {"ROOT_RO", "WS_OK", "TMP_OK", "/workspace"} <= set(out.splitlines()), result
    assert "Read-only file system" in result["stderr"]
    assert "CapEff:\t0000000000000000" in out
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert env["BOX_GREETING"] == "hello"
    # the call's own attempt (docs/manifests.md#idempotency) is all it gets of Cortex's
    assert env["CORTEX_ATTEMPT"] == "1" and env["CORTEX_ACTION_ID"] == "box"
    assert env["CORTEX_IDEMPOTENCY_KEY"] == f"{env['CORTEX_JOB_ID']}:box"
    leaked = [k for k in env if (k.startswith(("CORTEX_", "DOCKER_", "PYTEST", "CELERY"))
                                 and k not in ATTEMPT_ENV)
              or (k in os.environ and k not in ("PATH", "HOME", "HOSTNAME", "PWD", "SHLVL"))]
    assert not leaked, env


def test_no_network_by_default_host_network_when_asked(
    api: Any, loopback_server: tuple[int, list[str]]
) -> None:
    port, hits = loopback_server
    _, events = run(api, action("none", "box_net", {"port": port, "path": "from-none"})
                    + action("host", "box_net_host", {"port": port, "path": "from-host"}))
    failed = one(events, "action_failed", "none")["data"]["error"]
    assert "exited with status 1" in failed and "Connection refused" in failed, failed
    reply = one(events, "action_completed", "host")["data"]["result"]["stdout"]
    assert reply.startswith("HTTP/1.0 200") and reply.endswith("pong"), reply
    assert hits == ["/from-host"]


def test_cgroup_limits_inside_the_container(api: Any) -> None:
    script = ("cat /sys/fs/cgroup/memory.max 2>/dev/null "
              "|| cat /sys/fs/cgroup/memory/memory.limit_in_bytes; "
              "cat /sys/fs/cgroup/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids/pids.max")
    _, events = run(api, action("limits", "box_sh", {"script": script}))
    lines = one(events, "action_completed", "limits")["data"]["result"]["stdout"].split()
    assert lines == [str(64 * MIB), "32"]  # box_sh: limits {memory_mb: 64, processes: 32}


def test_limits_while_running_then_timeout_kills_and_removes(
    api: Any, dockerd: DockerDaemon, cortex_env: dict[str, str]
) -> None:
    response = submit(api, action("nap", "box_sleep", {"seconds": 60}, timeout=4))
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    container = wait_job_container(api, dockerd, job_id)
    host = container.attrs["HostConfig"]
    assert host["Memory"] == host["MemorySwap"] == 48 * MIB  # box_sleep: memory_mb 48
    assert host["PidsLimit"] == 24 and host["NanoCpus"] == 500_000_000
    assert host["ReadonlyRootfs"] is True and host["Privileged"] is False
    assert host["CapDrop"] == ["ALL"] and host["SecurityOpt"] == ["no-new-privileges"]
    assert host["NetworkMode"] == "none" and host["LogConfig"]["Type"] == "none"
    assert host["Binds"] == [f"{workspace_of(cortex_env, job_id).resolve()}:/workspace:rw"]
    labels = container.attrs["Config"]["Labels"]
    assert labels[sandbox_docker.LABEL_ACTION] == "nap"
    assert labels[sandbox_docker.LABEL_TOOL] == "box_sleep"
    host, _, pid = labels[sandbox_docker.LABEL_WORKER].rpartition(":")
    assert host == socket.gethostname() and pid.isdigit()  # whose container, if it dies
    owner = workspace_of(cortex_env, job_id).stat()
    assert container.attrs["Config"]["User"] == f"{owner.st_uid}:{owner.st_gid}"

    events = follow(api, job_id)
    # the action's 4 s timeout ended it, not the minute's sleep: the container was killed
    failed = one(events, "action_failed", "nap")["data"]
    assert failed["status"] == "timeout", failed
    assert failed["error"].startswith("timed out after 4s (the container was killed)"), failed
    assert not of(events, "action_completed") and events[-1]["type"] == "job_failed"
    assert job_containers(dockerd, job_id) == []


def test_cancel_removes_the_running_container(api: Any, dockerd: DockerDaemon) -> None:
    response = submit(api, action("nap", "box_sleep", {"seconds": 60}))
    job_id = response.json()["id"]
    wait_job_container(api, dockerd, job_id)
    cancel = httpx.post(f"{api.url}/v1/jobs/{job_id}/cancel")
    assert cancel.status_code in (200, 202), cancel.text
    assert follow(api, job_id)[-1]["type"] == "job_cancelled"
    harness.wait_until(lambda: not job_containers(dockerd, job_id), timeout=15,
                       message="the cancelled action's container was not removed")


def test_non_zero_exit_fails_with_the_stderr_tail(api: Any) -> None:
    _, events = run(api, action("bad", "box_sh", {"script": "echo oops >&2; exit 7"}))
    error = one(events, "action_failed", "bad")["data"]["error"]
    assert "exited with status 7" in error and "oops" in error, error
    assert events[-1]["type"] == "job_failed"


def test_missing_image_fails_cleanly_and_the_worker_survives(
    api: Any, dockerd: DockerDaemon, docker_worker: harness.Process
) -> None:
    _, events = run(api, action("gone", "box_missing", {})
                    + action("fine", "box_echo", {"message": "still here"}))
    error = one(events, "action_failed", "gone")["data"]["error"]
    assert "image 'cortex-test/missing:1' is not available on this docker host" in error
    assert "build or pull it first" in error
    assert one(events, "action_completed", "fine")["data"]["result"]["stdout"] == "still here\n"
    assert events[-1]["type"] == "job_failed"
    assert not of(events, "action_retrying")
    client = dockerd.client()
    try:  # never pulled
        assert not client.images.list(name="cortex-test/missing")
    finally:
        client.close()
    _, again = run(api, action("after", "box_echo", {"message": "after"}))
    assert again[-1]["type"] == "job_completed"
    assert docker_worker.alive


# --------------------------------------------------------------------------- in process


def box(**fields: Any) -> ToolSpec:
    return ToolSpec(name="box", runtime="docker", image=TEST_IMAGE, **fields)


def test_stdin_and_capped_output(settings: Settings) -> None:
    ctx = ToolContext.for_job(settings, "job-stdin", "a1", timeout=20)
    data = b"x" * (3 * MIB) + b"\nend\n"
    result = sandbox_docker.run_container(box(), ["wc", "-c"], ctx, stdin=data)
    assert result.ok and result.stdout.split() == [str(len(data)).encode()]
    chatty = sandbox_docker.run_container(box(), ["sh", "-c", "yes | head -c 1000000"], ctx,
                                          max_output_bytes=1000)
    assert len(chatty.stdout) == 1000 and chatty.stdout_truncated


def test_out_of_memory_is_explained(settings: Settings) -> None:
    ctx = ToolContext.for_job(settings, "job-oom", "a1", timeout=20)
    spec = box(command=["sh", "-c", "head -c 200000000 /dev/zero | tail > /dev/null"],
               limits={"memory_mb": 16})
    with pytest.raises(ToolError, match=r"status 137 \(out of memory: the limit is 16 MiB\)"):
        run_tool(spec, {}, ctx)


def test_timeout_in_process(settings: Settings, dockerd: DockerDaemon) -> None:
    ctx = ToolContext.for_job(settings, "job-timeout", "a1", timeout=1)
    with pytest.raises(ToolTimeout, match=r"^timed out after 1s \(the container was killed\)$"):
        run_tool(box(command=["sh", "-c", "sleep 30; touch /workspace/slept"]), {}, ctx)
    # the timeout ended it before the 30 s sleep was over: the file the container would have
    # written after it is not there, and the container is gone
    assert not (ctx.workspace / "slept").exists()
    assert job_containers(dockerd, "job-timeout") == []


def test_bad_command_is_a_tool_error(settings: Settings, dockerd: DockerDaemon) -> None:
    ctx = ToolContext.for_job(settings, "job-badcmd", "a1", timeout=20)
    with pytest.raises(ToolError, match=r"cannot start the container: .*no-such-program"):
        run_tool(box(command=["no-such-program"]), {}, ctx)
    assert job_containers(dockerd, "job-badcmd") == []


def test_unreachable_daemon_is_a_clear_tool_error(tmp_path: Path) -> None:
    # Needs no dockerd: runs everywhere.
    settings = Settings(docker_host=f"unix://{tmp_path}/no.sock", workspace_root=tmp_path)
    ctx = ToolContext.for_job(settings, "job-nodaemon", "a1", timeout=5)
    with pytest.raises(ToolError, match=r"cannot reach the Docker daemon at unix://.*no\.sock"):
        run_tool(box(command=["true"]), {}, ctx)


def test_docker_options_belong_to_the_docker_runtime() -> None:
    assert box(network="host", cpus=0.25, read_only=False, workdir="/tmp").network == "host"
    with pytest.raises(ValueError, match="runtime 'shell' does not use cpus"):
        ToolSpec(name="s", runtime="shell", command=["true"], cpus=1)
    # `network` also applies to python and shell tools (their own namespace unless "host")
    assert ToolSpec(name="s", runtime="shell", command=["true"], network="host").network == "host"
    with pytest.raises(ValueError, match="network"):
        box(network="bridge")
    with pytest.raises(ValueError, match="workdir"):
        box(workdir="relative")


def test_container_config_defaults(tmp_path: Path) -> None:
    settings = Settings(workspace_root=tmp_path)
    ctx = ToolContext.for_job(settings, "job-config", "a1", timeout=5)
    create, host = sandbox_docker.container_config(box(env={"A": "1"}), [], ctx)
    assert create["command"] is None and create["working_dir"] == "/workspace"
    assert create["environment"] == {"A": "1", **ctx.identity.env()}  # the manifest's, the call's
    assert create["use_config_proxy"] is False
    assert host["network_mode"] == "none" and host["read_only"] is True
    assert host["mem_limit"] == host["memswap_limit"] == 512 * MIB
    assert host["nano_cpus"] == 1_000_000_000 and host["pids_limit"] == 64
    options = dataclasses.asdict(sandbox_docker.ContainerResult(0, b"", b"", False, 0.0))
    assert set(options) >= {"exit_code", "stdout", "stderr", "timed_out", "duration_s"}
