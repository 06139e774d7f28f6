"""Cortex as an MCP server: the official `mcp` client against the real API and workers.

The `tester` agent answers from the fake model server under its own model name (an MCP call
passes no job options), so each test scripts `tester` turns and leaves none behind.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import httpx2
import pytest
from mcp import Client, ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS, CallToolResult

from tests import harness
from tests.fake_llm import FakeLLM
from tests.integration.test_agents import act, final, turn
from tests.manifest_helpers import TEST_AGENTS

ALPHA, BETA = f"mcp-alpha-{uuid.uuid4().hex}", f"mcp-beta-{uuid.uuid4().hex}"


@pytest.fixture
def api(workers: Any, api: harness.Process) -> harness.Process:  # calls need the pools
    return api


@pytest.fixture
def llm(fake_llm: FakeLLM) -> Iterator[FakeLLM]:
    yield fake_llm
    assert fake_llm.remaining("tester") == 0, "tester turns left unused"


@pytest.fixture(scope="module")
def keyed_api(cortex_env: dict[str, str], harness_dir: Path) -> Iterator[harness.Process]:
    """An API whose keys name two tenants."""
    env = {**cortex_env, "CORTEX_API_KEYS": f"alpha:{ALPHA},beta:{BETA}"}
    with harness.api_running(env, log_dir=harness_dir, cwd=harness_dir) as proc:
        yield proc


@asynccontextmanager
async def connect(url: str, key: str | None = None) -> AsyncIterator[ClientSession]:
    """An initialized MCP session with the API at `url` (bearer `key`, if any)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with (httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=120)) as http,
                streamable_http_client(f"{url}/mcp", http_client=http) as (read, write),
                ClientSession(read, write) as session):
        await session.initialize()
        yield session


def text(result: CallToolResult) -> str:
    (block,) = result.content
    assert block.type == "text"
    return block.text


def test_tools_are_the_agents_with_their_schemas(api: harness.Process) -> None:
    async def main() -> None:
        async with connect(api.url) as session:
            assert session.server_capabilities is not None
            assert session.server_capabilities.tools is not None
            tools = (await session.list_tools()).tools
        assert [tool.name for tool in tools] == TEST_AGENTS
        tester = next(tool for tool in tools if tool.name == "tester")
        assert tester.description == "The agent most integration tests run."
        schema = tester.input_schema
        assert schema["required"] == ["input"]
        assert schema["properties"]["input"]["type"] == "string"
        assert schema["properties"]["session_id"]["type"] == "string"
        assert schema["additionalProperties"] is False
        assert tester.output_schema is not None
        assert set(tester.output_schema["required"]) == {"job_id", "status", "result"}

    anyio.run(main)


def test_a_call_runs_the_agent_and_reports_progress(api: harness.Process,
                                                     llm: FakeLLM) -> None:
    """The answer is the job's final response, its structured content names the job, and
    progress notifications follow the job's events as they are logged."""
    llm.script("tester", [
        turn(act("a", "echo", {"message": "pong"})),
        turn(final("The echo said $a.")),
    ])
    progress: list[tuple[float, str | None]] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append((value, message))

    async def main() -> CallToolResult:
        async with connect(api.url) as session:
            return await session.call_tool("tester", {"input": "Echo pong."},
                                           progress_callback=on_progress)

    result = anyio.run(main)
    assert not result.is_error
    assert text(result) == "The echo said pong."
    outcome = result.structured_content
    assert outcome is not None
    assert (outcome["status"], outcome["result"], outcome["error"]) == \
        ("completed", "The echo said pong.", None)
    job = httpx.get(f"{api.url}/v1/jobs/{outcome['job_id']}", timeout=30).json()
    assert (job["status"], job["agent"], job["result"]) == \
        ("completed", "tester", "The echo said pong.")

    messages = [message for _, message in progress]
    assert messages == [f"job {outcome['job_id']} queued", "job started", "turn 1",
                        "action a started", "action a completed", "turn 2", "job completed"]
    values = [value for value, _ in progress]
    assert values == sorted(values) and len(set(values)) == len(values)  # seqs: increasing


def test_the_2026_07_28_envelope_serves_the_same_call(api: harness.Process,
                                                      llm: FakeLLM) -> None:
    """The SDK's `Client` negotiates 2026-07-28 (no handshake, a per-request envelope): the
    same tools, result and progress."""
    llm.script("tester", [turn(final("Modern."))])
    progress: list[str | None] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append(message)

    async def main() -> CallToolResult:
        async with Client(f"{api.url}/mcp") as client:
            assert client.protocol_version == "2026-07-28"
            assert "tester" in [tool.name for tool in (await client.list_tools()).tools]
            return await client.call_tool("tester", {"input": "Hi."},
                                          progress_callback=on_progress)

    result = anyio.run(main)
    assert not result.is_error and text(result) == "Modern."
    assert progress[-1] == "job completed" and "turn 1" in progress


def test_session_id_continues_a_session(api: harness.Process, llm: FakeLLM) -> None:
    llm.script("tester", [turn(final("Hello, Ada.")), turn(final("You are Ada."))])
    created = httpx.post(f"{api.url}/v1/sessions", json={"agent": "tester"}, timeout=30)
    assert created.status_code == 201, created.text
    session_id = created.json()["id"]

    async def main() -> list[CallToolResult]:
        async with connect(api.url) as session:
            first = await session.call_tool("tester", {"input": "I am Ada.",
                                                       "session_id": session_id})
            second = await session.call_tool("tester", {"input": "Who am I?",
                                                        "session_id": session_id})
            return [first, second]

    first, second = anyio.run(main)
    assert [text(first), text(second)] == ["Hello, Ada.", "You are Ada."]
    # the second turn's model saw the conversation so far
    request = llm.requests("tester")[-1]
    said = [(m["role"], m["content"]) for m in request["messages"][1:]]
    assert ("user", "I am Ada.") in said and ("user", "Who am I?") in said
    view = httpx.get(f"{api.url}/v1/sessions/{session_id}", timeout=30).json()
    assert view["jobs"] == [first.structured_content["job_id"],
                            second.structured_content["job_id"]]


def test_bad_arguments_are_tool_errors_naming_the_argument(api: harness.Process) -> None:
    async def main() -> list[CallToolResult]:
        async with connect(api.url) as session:
            return [await session.call_tool("tester", {}),
                    await session.call_tool("tester", {"input": 42}),
                    await session.call_tool("tester", {"input": "hi", "model": "x"}),
                    await session.call_tool("tester", {"input": "hi",
                                                       "session_id": "no-such-session"})]

    missing, wrong_type, extra, unknown_session = anyio.run(main)
    for result in (missing, wrong_type, extra, unknown_session):
        assert result.is_error
    assert text(missing).startswith("argument input: Field required")
    assert text(wrong_type).startswith("argument input: Input should be a valid string")
    assert text(extra).startswith("argument model: Extra inputs are not permitted")
    assert text(unknown_session) == "session_id: no session 'no-such-session'"


def test_an_unknown_tool_is_a_protocol_error(api: harness.Process) -> None:
    async def main() -> None:
        async with connect(api.url) as session:
            with pytest.raises(MCPError) as raised:
                await session.call_tool("nobody", {"input": "hi"})
        assert raised.value.error.code == INVALID_PARAMS
        assert "nobody" in raised.value.error.message

    anyio.run(main)


def test_a_failed_job_is_a_tool_error_with_its_error(api: harness.Process,
                                                     llm: FakeLLM) -> None:
    llm.script("tester", [turn(fail_status=400, error_message="no such model")])

    async def main() -> CallToolResult:
        async with connect(api.url) as session:
            return await session.call_tool("tester", {"input": "Fail."})

    result = anyio.run(main)
    assert result.is_error
    outcome = result.structured_content
    assert outcome is not None and outcome["status"] == "failed" and outcome["error"]
    assert text(result) == f"job {outcome['job_id']} failed: {outcome['error']}"


def test_keys_are_bearer_tokens_and_tenants_apply(workers: Any, keyed_api: harness.Process,
                                                  llm: FakeLLM) -> None:
    """Without a key (or with a wrong one) `/mcp` is 401; with one, the job is its tenant's,
    and another tenant's session is not found."""
    ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    headers = {"Accept": "application/json, text/event-stream"}
    for auth in ({}, {"Authorization": "Bearer wrong"}):
        refused = httpx.post(f"{keyed_api.url}/mcp", json=ping, headers={**headers, **auth},
                             timeout=30)
        assert refused.status_code == 401, refused.text
        assert refused.headers["WWW-Authenticate"].startswith("Bearer")

    async def refused_by_the_client() -> None:
        async with connect(keyed_api.url):
            pass

    # the SDK's client reports the 401 as an error of `initialize`
    with pytest.RaisesGroup(pytest.RaisesExc(MCPError), flatten_subgroups=True):
        anyio.run(refused_by_the_client)

    llm.script("tester", [turn(final("Yours, alpha."))])
    created = httpx.post(f"{keyed_api.url}/v1/sessions", json={"agent": "tester"},
                         headers={"Authorization": f"Bearer {ALPHA}"}, timeout=30)
    assert created.status_code == 201, created.text
    alphas = created.json()["id"]

    async def main() -> list[CallToolResult]:
        async with connect(keyed_api.url, ALPHA) as alpha, connect(keyed_api.url, BETA) as beta:
            assert "tester" in [tool.name for tool in (await beta.list_tools()).tools]
            return [await alpha.call_tool("tester", {"input": "Hi.", "session_id": alphas}),
                    await beta.call_tool("tester", {"input": "Hi.", "session_id": alphas})]

    mine, theirs = anyio.run(main)
    assert text(mine) == "Yours, alpha."
    job_id = mine.structured_content["job_id"]
    as_alpha = httpx.get(f"{keyed_api.url}/v1/jobs/{job_id}",
                         headers={"Authorization": f"Bearer {ALPHA}"}, timeout=30)
    as_beta = httpx.get(f"{keyed_api.url}/v1/jobs/{job_id}",
                        headers={"Authorization": f"Bearer {BETA}"}, timeout=30)
    assert (as_alpha.status_code, as_beta.status_code) == (200, 404)
    assert theirs.is_error and text(theirs) == f"session_id: no session {alphas!r}"
