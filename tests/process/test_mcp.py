"""MCP servers as tool sources: the manifest, listing tools at load (once for the cluster,
shared through Redis), the relic lifecycle of a server in `MCPManager`, cancellation and
errors, stdio and streamable HTTP.

The servers are real processes: tests/mcp_servers/faulty.py (the MCP SDK's MCPServer), which
crashes, hangs or fails on request. Each start costs about a second, so the manager and the
HTTP server are shared by the tests of this module.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mcp_types as types
import pytest
from pydantic import ValidationError

from cortex_worker.manifests.loader import ManifestError, load_registry
from cortex_worker.services.mcp import client
from cortex_worker.services.mcp.client import result_value
from cortex_worker.services.mcp.listing import (
    FAILURE_TTL_S,
    SharedListing,
    listing_key,
    shared_listing,
)
from cortex_worker.services.mcp.manager import MCPManager
from cortex_worker.services.mcp.spec import MCPServerSpec, needs_listing, tool_name
from cortex_worker.settings import Settings
from cortex_worker.tools.context import ToolContext
from cortex_worker.tools.errors import ToolError, ToolTimeout
from cortex_worker.tools.runtime import run_tool
from cortex_worker.tools.spec import queue_for
from tests.harness import RedisServer, free_port, wait_until
from tests.manifest_helpers import REPO_ROOT, TEST_MANIFESTS, load_error, write

pytestmark = pytest.mark.process

FAULTY = REPO_ROOT / "tests" / "mcp_servers" / "faulty.py"
CHANGING = REPO_ROOT / "tests" / "mcp_servers" / "changing.py"
FAULTY_COMMAND = json.dumps([sys.executable, str(FAULTY)])
PINNED = """
    kind: MCPServer
    name: faulty
    command: ["{python}", "/no/such/server.py"]
    tools:
      - name: pid
        parameters: {type: object}
      - name: fail
        description: Fails.
        parameters: {type: object, properties: {message: {type: string}}, required: [message]}
        timeout: 7
    """


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # manifest errors name files relative to here


# ---------------------------------------------------------------- the manifest


@pytest.mark.parametrize(("data", "message"), [
    ({}, "give either command"),
    ({"command": ["x"], "url": "http://127.0.0.1:1/mcp"}, "give either command"),
    ({"url": "ftp://host/mcp"}, "must be an http:// or https:// URL"),
    ({"url": "http://127.0.0.1:1/mcp", "env": {"A": "b"}}, "env: only for a stdio server"),
    ({"command": ["x"], "headers": {"A": "b"}}, "headers: only for an HTTP server"),
    ({"command": ["{port}"]}, "command[0]: unknown placeholder {port}"),
    ({"command": ["x"], "tools": [{"name": "a"}, {"name": "a"}]}, "tools[1]: 'a' is listed twice"),
    ({"command": ["x"], "tools": [{"name": "a" * 70}]}, "is not a valid tool name"),
    ({"command": ["x"], "tools": [{"name": "a", "parameters": {"type": "array"}}]},
     "the root must be of type 'object'"),
])
def test_the_manifest_is_checked(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("[", r"\[").replace("{", r"\{")):
        MCPServerSpec.model_validate({"name": "srv", **data})


def test_a_server_name_has_no_dots() -> None:
    with pytest.raises(ValidationError, match="not a valid MCP server name"):
        MCPServerSpec(name="my.server", command=["x"])


def test_a_tool_manifest_cannot_declare_runtime_mcp(tmp_path: Path) -> None:
    write(tmp_path, "t.yaml", "kind: Tool\nname: t\nruntime: mcp\nserver: s\n")
    assert "runtime: 'mcp' tools come from MCP servers: declare the server with kind: " \
           "MCPServer" in load_error(tmp_path)
    write(tmp_path, "t.yaml", "kind: Tool\nname: t\nruntime: perl\n")
    assert load_error(tmp_path).endswith(
        "runtime: Input should be 'python', 'shell', 'docker' or 'builtin'")


def test_pinned_tools_load_without_starting_the_server(tmp_path: Path) -> None:
    write(tmp_path, "mcp.yaml", PINNED)
    registry = load_registry(tmp_path)
    server = registry.mcp_servers["faulty"]
    assert not needs_listing(server) and server.base_dir == tmp_path.resolve()
    assert sorted(n for n in registry.tools if n.startswith("faulty.")) == [
        "faulty.fail", "faulty.pid"]
    fail = registry.tools["faulty.fail"]
    assert (fail.runtime, fail.server, fail.description, fail.timeout) == (
        "mcp", "faulty", "Fails.", 7.0)
    assert fail.mcp_server is server and tool_name(fail) == "fail"
    assert queue_for(fail) == "relic"
    assert registry.source("Tool", "faulty.pid") == "mcp.yaml (MCP server faulty)"


def test_parameters_are_validated_before_the_server_is_asked(tmp_path: Path) -> None:
    write(tmp_path, "mcp.yaml", PINNED)
    registry = load_registry(tmp_path)
    ctx = ToolContext.for_job(Settings(workspace_root=tmp_path), "job-1", "act-1", timeout=5)
    with pytest.raises(ToolError, match="parameter 'message': 5 is not of type 'string'"):
        run_tool(registry.tools["faulty.fail"], {"message": 5}, ctx)
    assert not (tmp_path / "mcp").exists()  # nothing was started


# ---------------------------------------------------------------- listing at load time


def test_tools_are_listed_from_the_server_when_the_manifests_load(tmp_path: Path) -> None:
    write(tmp_path, "servers/mcp.yaml", f"""
        mcp_servers:
          - name: faulty
            command: {FAULTY_COMMAND}
            timeout: 9
          - name: only_pid
            command: ["{{python}}", faulty.py]
            cwd: ../mcp_servers
            tools: [{{name: pid, description: Its pid.}}]
        agents:
          - name: a
            model: {{base_url: "http://127.0.0.1:9", model: m, api_key_env: null}}
            tools: [faulty.hang, only_pid.pid]
        """)
    (tmp_path / "mcp_servers").mkdir()
    (tmp_path / "mcp_servers" / "faulty.py").write_text(FAULTY.read_text())
    registry = load_registry(tmp_path)
    assert sorted(n for n in registry.tools if "." in n) == [
        "faulty.crash", "faulty.fail", "faulty.hang", "faulty.pid", "only_pid.pid"]
    hang = registry.tools["faulty.hang"]
    assert hang.parameters["required"] == ["marker"]
    assert hang.parameters["properties"]["seconds"] == {
        "default": 3600, "title": "Seconds", "type": "number"}
    assert hang.description.startswith("Sleep `seconds`; mark the file")
    assert hang.timeout == 9
    assert registry.tools["faulty.pid"].returns is not None  # its output schema
    only = registry.tools["only_pid.pid"]
    assert only.description == "Its pid." and only.parameters["type"] == "object"
    assert registry.agents["a"].tools == ["faulty.hang", "only_pid.pid"]


def test_a_listing_is_kept_for_the_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, "mcp.yaml", f"kind: MCPServer\nname: faulty\ncommand: {FAULTY_COMMAND}\n")
    load_registry(tmp_path)
    monkeypatch.setattr(client, "launch", lambda *a: pytest.fail("started again"))
    assert "faulty.crash" in load_registry(tmp_path).tools


@pytest.mark.parametrize(("command", "expected"), [
    ('["no-such-mcp-server"]', "command not found: 'no-such-mcp-server'"),
    ('["{python}", "-c", "import sys; print(\'bad config\', file=sys.stderr); sys.exit(4)"]',
     "it exited with code 4; its output ends with:\nbad config"),
])
def test_a_server_that_cannot_list_its_tools_is_a_manifest_error(
        tmp_path: Path, command: str, expected: str) -> None:
    write(tmp_path, "mcp.yaml", f"kind: MCPServer\nname: broken\ncommand: {command}\n")
    error = load_error(tmp_path)
    assert error.startswith("mcp.yaml: MCPServer 'broken': cannot list the tools of MCP server "
                            "'broken': ")
    assert expected in error
    assert error.endswith("(pin them under tools:, with their parameters, to load the manifests "
                          "without asking the server)")


def test_a_pinned_tool_the_server_lacks_is_a_manifest_error(tmp_path: Path) -> None:
    write(tmp_path, "mcp.yaml", f"kind: MCPServer\nname: faulty\ncommand: {FAULTY_COMMAND}\n"
                                "tools: [{name: pid}, {name: teleport}]\n")
    assert load_error(tmp_path) == (
        "mcp.yaml: MCPServer 'faulty': tools[1]: the server has no tool 'teleport' (it lists: "
        "crash, fail, hang, pid)")


def test_an_mcp_tool_clashing_with_a_tool_is_a_manifest_error(tmp_path: Path) -> None:
    write(tmp_path, "mcp.yaml", PINNED)
    write(tmp_path, "tools.yaml", "kind: Tool\nname: faulty.pid\nruntime: shell\n"
                                  "command: [echo]\n")
    assert "tool 'faulty.pid' is already defined in tools.yaml" in load_error(tmp_path)


def test_the_test_manifests_list_the_time_server() -> None:
    registry = load_registry(TEST_MANIFESTS)
    tool = registry.tools["time.get_current_time"]
    assert tool.runtime == "mcp" and tool.parameters["required"] == ["timezone"]


# ---------------------------------------------------------------- listings shared through Redis


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    where = tmp_path_factory.mktemp("listing-redis")
    with RedisServer(log_dir=where, data_dir=where / "data") as server:
        yield server.url


class CountingLister:
    """A `Lister` that answers `answer` (slowly, if told) and counts the servers it was asked."""

    def __init__(self, answer: Any = (), delay: float = 0.0) -> None:
        self.answer, self.delay, self.asked = answer, delay, []

    def __call__(self, servers: Any) -> dict[str, Any]:
        time.sleep(self.delay)
        self.asked += [spec.name for spec in servers]
        answer = self.answer
        return {spec.name: answer if isinstance(answer, Exception)
                else [{"name": "pid", "inputSchema": {"type": "object"}}] for spec in servers}


def sharing(url: str, lister: CountingLister, ttl: float = 60) -> SharedListing:
    listing = shared_listing(url, ttl)
    listing.list_servers = lister
    return listing


def test_one_process_lists_a_server_the_others_read_it(redis_url: str) -> None:
    spec = MCPServerSpec(name=f"s{time.monotonic_ns()}", command=["srv"])
    first, second = CountingLister(), CountingLister()
    assert sharing(redis_url, first)([spec]) == sharing(redis_url, second)([spec])
    assert (first.asked, second.asked) == ([spec.name], [])
    ttl = sharing(redis_url, first).redis.pttl(listing_key(spec))
    assert 50_000 < ttl <= 60_000
    other = spec.model_copy(update={"command": ["srv", "--other"]})  # another configuration
    assert listing_key(other) != listing_key(spec)
    sharing(redis_url, second)([other])
    assert second.asked == [spec.name]


def test_processes_starting_together_list_a_server_once(redis_url: str) -> None:
    spec = MCPServerSpec(name=f"s{time.monotonic_ns()}", command=["srv"])
    lister = CountingLister(delay=0.5)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: sharing(redis_url, lister)([spec]), range(4)))
    assert lister.asked == [spec.name]
    assert all(answer == answers[0] for answer in answers)


def test_a_failed_listing_is_shared_briefly(redis_url: str) -> None:
    spec = MCPServerSpec(name=f"s{time.monotonic_ns()}", command=["srv"])
    failing = CountingLister(ToolError("it exited with code 4"), delay=0.3)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: sharing(redis_url, failing)([spec])[spec.name],
                                range(3)))
    assert failing.asked == [spec.name]
    assert [str(answer) for answer in answers] == ["it exited with code 4"] * 3
    listing = sharing(redis_url, failing)
    assert 0 < listing.redis.ttl(listing_key(spec)) <= FAILURE_TTL_S
    listing.forget(spec)  # as after FAILURE_TTL_S: the next process asks the server again
    assert str(listing([spec])[spec.name]) == "it exited with code 4"
    assert failing.asked == [spec.name] * 2


def test_without_redis_a_process_lists_the_servers_itself() -> None:
    spec = MCPServerSpec(name="s", command=["srv"])
    lister = CountingLister()
    assert sharing(f"redis://127.0.0.1:{free_port()}/0", lister)([spec])["s"][0]["name"] == "pid"
    assert lister.asked == ["s"]


def test_loading_the_manifests_reads_the_shared_listing(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, "mcp.yaml", f"kind: MCPServer\nname: faulty\ncommand: {FAULTY_COMMAND}\n"
                                "startup_timeout_s: 29\n")  # a configuration of its own
    listing = shared_listing(redis_url, 60)
    assert "faulty.crash" in load_registry(tmp_path, list_mcp_tools=listing).tools
    client._listed.clear()  # another process: it knows nothing, and starts nothing
    monkeypatch.setattr(client, "launch", lambda *a: pytest.fail("started again"))
    registry = load_registry(tmp_path, list_mcp_tools=listing)
    assert registry.tools["faulty.hang"].parameters["required"] == ["marker"]


def test_a_server_that_cannot_list_its_tools_is_the_same_error_from_the_shared_listing(
        redis_url: str, tmp_path: Path) -> None:
    command = '["{python}", "-c", "import sys; print(\'bad config\', file=sys.stderr); sys.exit(4)"]'
    write(tmp_path, "mcp.yaml", f"kind: MCPServer\nname: broken\ncommand: {command}\n")
    listing = shared_listing(redis_url, 60)
    errors = []
    for _ in range(2):  # asked, then read from Redis
        with pytest.raises(ManifestError) as info:
            load_registry(tmp_path, list_mcp_tools=listing)
        errors.append(str(info.value))
    assert errors[0] == errors[1]
    assert errors[0].startswith("mcp.yaml: MCPServer 'broken': cannot list the tools of MCP "
                                "server 'broken': it exited with code 4; its output ends with:\n"
                                "bad config")


def test_the_relic_pool_refreshes_the_listing_and_drops_it_when_the_tools_change(
        redis_url: str, tmp_path: Path) -> None:
    spec = MCPServerSpec(name="changing", command=["{python}", str(CHANGING)])
    mgr = MCPManager(tmp_path / "mcp")
    mgr.listing = shared_listing(redis_url, 60)
    try:
        key = listing_key(spec)
        mgr.listing.redis.delete(key)
        assert mgr.call_tool(spec, "change", {}, 20) == {"result": "changed"}  # connected: published...
        # ... and the server said its tools changed: dropped (the notification may come after)
        wait_until(lambda: mgr.listing.redis.get(key) is None, timeout=10)
        mgr.stop("changing")
        assert [t["name"] for t in mgr.tools(spec)] == ["change"]  # connected again: published
        assert json.loads(mgr.listing.redis.get(key))["tools"][0]["name"] == "change"
    finally:
        mgr.stop_all()


# ---------------------------------------------------------------- results


def test_a_result_becomes_a_value() -> None:
    def result(content: list[dict[str, Any]], **extra: Any) -> types.CallToolResult:
        return types.CallToolResult.model_validate({"content": content, **extra})

    text = {"type": "text", "text": "hello"}
    assert result_value(result([text], structuredContent={"a": 1})) == {"a": 1}
    assert result_value(result([text, text])) == "hello\nhello"
    assert result_value(result([{"type": "text", "text": '{"b": [1]}'}])) == {"b": [1]}
    assert result_value(result([{"type": "text", "text": "[not json"}])) == "[not json"
    assert result_value(result([])) is None
    image = {"type": "image", "data": "aGk=", "mimeType": "image/png"}
    assert result_value(result([text, image])) == [text, image]


# ---------------------------------------------------------------- the lifecycle


@pytest.fixture(scope="module")
def manager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MCPManager]:
    mgr = MCPManager(tmp_path_factory.mktemp("mcp"))
    try:
        yield mgr
    finally:
        mgr.stop_all()


@pytest.fixture(scope="module")
def faulty() -> MCPServerSpec:
    return MCPServerSpec(name="faulty", command=["{python}", str(FAULTY)], idle_timeout_s=60,
                         health={"interval_s": 60})


def pid_of(manager: MCPManager, spec: MCPServerSpec) -> int:
    return int(manager.call_tool(spec, "pid", {}, 20)["pid"])


def marks(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_started_on_first_use_then_reused(manager: MCPManager, faulty: MCPServerSpec) -> None:
    first = pid_of(manager, faulty)
    assert manager.running() == {"faulty": first}
    assert pid_of(manager, faulty) == first
    assert [t["name"] for t in manager.tools(faulty)] == ["pid", "crash", "hang", "fail"]
    log = (manager.root / "logs" / "faulty.log").read_text()
    assert f"starting MCP server faulty: ['{{python}}', '{FAULTY}']" in log


def test_an_error_result_fails_with_its_message(manager: MCPManager,
                                                faulty: MCPServerSpec) -> None:
    with pytest.raises(ToolError, match=r"^MCP tool faulty.fail failed: .*no such record$"):
        manager.call_tool(faulty, "fail", {"message": "no such record"}, 20)
    with pytest.raises(ToolError, match=r"^MCP tool faulty.teleport failed: Unknown tool: "
                                        "teleport$"):
        manager.call_tool(faulty, "teleport", {}, 20)


def test_a_crash_fails_the_call_and_the_next_call_restarts_it(
        manager: MCPManager, faulty: MCPServerSpec) -> None:
    before = pid_of(manager, faulty)
    with pytest.raises(ToolError) as info:
        manager.call_tool(faulty, "crash", {"code": 3}, 20)
    assert str(info.value).startswith("MCP server 'faulty' exited with code 3 during tool "
                                      "'crash'; it is restarted on next use")
    assert "; its output ends with:\n" in str(info.value)
    assert str(info.value).endswith("\ncrashing on purpose")
    after = pid_of(manager, faulty)
    assert after != before and manager.running() == {"faulty": after}


def test_a_server_killed_between_calls_is_restarted(manager: MCPManager,
                                                   faulty: MCPServerSpec) -> None:
    before = pid_of(manager, faulty)
    os.killpg(before, signal.SIGKILL)
    wait_until(lambda: client.exit_code(before, 0) is not None, timeout=5)
    assert pid_of(manager, faulty) != before


def test_a_timeout_cancels_the_call_on_the_server(manager: MCPManager, faulty: MCPServerSpec,
                                                   tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    pid = pid_of(manager, faulty)
    # the timeout ended it, not the hour's hang: the error names it, and the server was told
    # to cancel the call (its handler was cancelled, not left to sleep on)
    with pytest.raises(ToolTimeout, match=r"^MCP tool faulty.hang did not answer within 1s; "
                                          "the server was sent notifications/cancelled$"):
        manager.call_tool(faulty, "hang", {"marker": str(marker)}, 1.0)
    wait_until(lambda: marks(marker) == ["started", "cancelled"], timeout=5)
    assert pid_of(manager, faulty) == pid  # the server lives on


def test_a_cancelled_action_cancels_the_call_on_the_server(
        manager: MCPManager, faulty: MCPServerSpec, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    cancelled = threading.Event()
    threading.Timer(0.5, cancelled.set).start()
    with pytest.raises(ToolError, match=r"^MCP tool faulty.hang: the job was cancelled; the "
                                        "server was sent notifications/cancelled$"):
        manager.call_tool(faulty, "hang", {"marker": str(marker)}, 30,
                          cancelled=lambda: "the job was cancelled" if cancelled.is_set() else None)
    wait_until(lambda: marks(marker) == ["started", "cancelled"], timeout=5)


def test_calls_share_the_session(manager: MCPManager, faulty: MCPServerSpec,
                                 tmp_path: Path) -> None:
    pid = pid_of(manager, faulty)
    markers = [tmp_path / f"m{i}" for i in range(3)]
    release = tmp_path / "release"
    results: list[Any] = []
    threads = [threading.Thread(target=lambda m=m: results.append(manager.call_tool(
        faulty, "hang", {"marker": str(m), "release": str(release)}, 20))) for m in markers]
    for thread in threads:
        thread.start()
    # at once, not one after another: all three run on the server before any has answered
    wait_until(lambda: all(marks(m) == ["started"] for m in markers), timeout=15)
    assert results == []
    release.touch()
    for thread in threads:
        thread.join()
    assert results == [{"released": 1.0}] * 3
    assert manager.running() == {"faulty": pid}  # over one connection


def test_stopped_when_idle_never_during_a_call(tmp_path: Path) -> None:
    manager = MCPManager(tmp_path)
    spec = MCPServerSpec(name="brief", command=["{python}", str(FAULTY)], idle_timeout_s=0.5)
    try:
        marker = tmp_path / "marker"
        results: list[Any] = []
        call = threading.Thread(target=lambda: results.append(manager.call_tool(
            spec, "hang", {"marker": str(marker), "seconds": 1.2}, 20)))
        call.start()
        wait_until(lambda: marks(marker) == ["started"], timeout=20)
        pid = manager.running()["brief"]
        call.join()
        assert results == [{"slept": 1.2}]  # longer than idle_timeout_s: the reaper waited
        wait_until(lambda: not manager.running(), timeout=10)
        wait_until(lambda: client.exit_code(pid, 0) is None, timeout=5)  # reaped
        wait_until(lambda: not list((tmp_path / "pids").glob("*.json")), timeout=5)  # forgotten
    finally:
        manager.stop_all()


def test_a_server_that_stops_answering_pings_is_restarted(manager: MCPManager) -> None:
    spec = MCPServerSpec(name="pinged", command=["{python}", str(FAULTY)],
                         health={"interval_s": 0.01, "timeout_s": 0.5})
    first = pid_of(manager, spec)
    assert pid_of(manager, spec) == first  # pinged, answered, reused
    os.kill(first, signal.SIGSTOP)  # alive, but deaf
    time.sleep(0.05)  # past health.interval_s: the next call pings first
    threading.Timer(1.0, lambda: os.kill(first, signal.SIGCONT)).start()  # so it can stop
    assert pid_of(manager, spec) != first
    manager.stop("pinged")


def test_a_server_that_does_not_answer_initialize_in_time(tmp_path: Path) -> None:
    write(tmp_path, "mcp.yaml", 'kind: MCPServer\nname: mute\nstartup_timeout_s: 0.5\n'
                                'command: ["{python}", "-c", "import time; time.sleep(60)"]\n')
    assert "it did not answer initialize and tools/list within 0.5s (startup_timeout_s)" in \
        load_error(tmp_path)
    manager = MCPManager(tmp_path / "mcp")
    spec = MCPServerSpec(name="mute", startup_timeout_s=0.5,
                         command=["{python}", "-c", "import time; time.sleep(60)"])
    with pytest.raises(ToolTimeout, match="^MCP server 'mute' did not answer initialize and "
                                          r"tools/list within 0.5s \(startup_timeout_s\)"):
        manager.call_tool(spec, "anything", {}, 20)
    assert manager.running() == {}


def test_a_server_that_does_not_start_is_an_action_error(tmp_path: Path) -> None:
    manager = MCPManager(tmp_path)
    spec = MCPServerSpec(name="dies", command=["{python}", "-c", "import sys; sys.exit(5)"])
    with pytest.raises(ToolError, match=r"^MCP server 'dies' exited with code 5 while starting"):
        manager.call_tool(spec, "anything", {}, 20)
    assert manager.running() == {}


# ---------------------------------------------------------------- streamable HTTP


@pytest.fixture(scope="module")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = (tmp_path_factory.mktemp("http") / "server.log").open("wb")
    proc = subprocess.Popen([sys.executable, str(FAULTY), "--http", str(port)], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        wait_until(lambda: _listening(port), timeout=20)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_an_http_server_is_listed_and_called(http_server: str, tmp_path: Path,
                                             manager: MCPManager) -> None:
    write(tmp_path, "mcp.yaml", f"kind: MCPServer\nname: remote\nurl: {http_server}\n"
                                "headers: {X-Token: '${CORTEX_TEST_MCP_TOKEN}'}\n")
    os.environ["CORTEX_TEST_MCP_TOKEN"] = "secret"
    try:
        registry = load_registry(tmp_path)
    finally:
        del os.environ["CORTEX_TEST_MCP_TOKEN"]
    assert sorted(n for n in registry.tools if n.startswith("remote.")) == [
        "remote.crash", "remote.fail", "remote.hang", "remote.pid"]
    spec = registry.mcp_servers["remote"]
    with pytest.raises(ToolError, match="environment variable 'CORTEX_TEST_MCP_TOKEN' is not set"):
        manager.call_tool(spec, "pid", {}, 20)
    os.environ["CORTEX_TEST_MCP_TOKEN"] = "secret"
    try:
        assert manager.call_tool(spec, "pid", {}, 20)["pid"] > 0
        assert manager.running()["remote"] == 0  # no process of ours
        with pytest.raises(ToolError, match=r"failed: .*remote says no"):
            manager.call_tool(spec, "fail", {"message": "remote says no"}, 20)
        marker = tmp_path / "marker"
        with pytest.raises(ToolTimeout):
            manager.call_tool(spec, "hang", {"marker": str(marker)}, 1.0)
        wait_until(lambda: marks(marker) == ["started", "cancelled"], timeout=5)
        assert manager.stop("remote") and "remote" not in manager.running()
    finally:
        del os.environ["CORTEX_TEST_MCP_TOKEN"]
