"""MCP servers end to end: manifests → API → the relic pool (threads) → an MCP server.

tests/manifests/mcp.yaml declares `time`, the real third-party server from PyPI
(`mcp-server-time`, stdio), whose tools are listed when the manifests load, and `faulty`
(tests/mcp_servers/faulty.py), whose tools are pinned and which crashes, hangs or fails on
request. Both run in the relic pool's worker, started on first use and kept between jobs.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import harness
from tests.fake_llm import FakeLLM, Turn

TERMINAL = {"job_completed", "job_failed", "job_cancelled"}


@pytest.fixture
def api(workers: Any, api: Any) -> Any:  # every test here needs the pools running
    return api


def submit(api: Any, protocol: str) -> httpx.Response:
    return httpx.post(f"{api.url}/v1/jobs", json={"protocol": protocol}, timeout=30)


def follow(api: Any, job_id: str, timeout: float = 90) -> list[dict[str, Any]]:
    """The job's events, read from its SSE stream until it closes."""
    events: list[dict[str, Any]] = []
    with httpx.stream("GET", f"{api.url}/v1/jobs/{job_id}/events", timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        data: list[str] = []
        for line in response.iter_lines():
            if line.startswith("data:"):
                data.append(line[5:].strip())
            elif line == "" and data:
                events.append(json.loads("\n".join(data)))
                data = []
    return events


def run(api: Any, protocol: str) -> list[dict[str, Any]]:
    response = submit(api, protocol)
    assert response.status_code == 202, response.text
    events = follow(api, response.json()["id"])
    assert events[-1]["type"] in TERMINAL
    return events


def one(events: list[dict[str, Any]], kind: str, action: str | None = None) -> dict[str, Any]:
    found = [e for e in events if e["type"] == kind
             and (action is None or e["data"].get("action_id") == action)]
    assert len(found) == 1, (kind, action, [(e["type"], e["data"]) for e in events])
    return found[0]["data"]


def tool(ident: str, name: str, params: dict[str, Any], **extra: Any) -> str:
    body = {"name": name, "parameters": params, **extra}
    return f'<action type="tool" id="{ident}">{json.dumps(body)}</action>\n'


def faulty_pid(api: Any) -> int:
    events = run(api, tool("p", "faulty.pid", {}))
    return int(one(events, "action_completed", "p")["result"]["pid"])


def marks(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


# ---------------------------------------------------------------- a real third-party server


def test_the_time_servers_tools_are_listed_with_their_schemas(api: Any) -> None:
    items = {t["name"]: t for t in httpx.get(f"{api.url}/v1/tools", timeout=30).json()["items"]}
    assert {"time.get_current_time", "time.convert_time"} <= set(items)
    listed = items["time.get_current_time"]
    assert listed["runtime"] == "mcp"
    assert listed["description"].startswith("Get current time in a specific timezone")
    assert listed["parameters"]["required"] == ["timezone"]
    assert listed["parameters"]["properties"]["timezone"]["type"] == "string"
    detail = httpx.get(f"{api.url}/v1/tools/time.get_current_time", timeout=30).json()
    assert set(detail["returns"]["properties"]) >= {"timezone", "datetime", "is_dst"}
    assert items["time.convert_time"]["parameters"]["required"] == [
        "source_timezone", "time", "target_timezone"]


def test_a_document_calls_the_time_server(api: Any, workers: Any) -> None:
    before = datetime.now(UTC)
    doc = (tool("now", "time.get_current_time", {"timezone": "UTC"})
           + tool("paris", "time.convert_time", {"source_timezone": "UTC", "time": "12:00",
                                                 "target_timezone": "Europe/Paris"})
           + '<response>It is ${now.datetime} in ${now.timezone}.</response>')
    events = run(api, doc)
    assert events[-1]["type"] == "job_completed", events[-1]
    now = one(events, "action_completed", "now")["result"]
    assert now["timezone"] == "UTC"
    told = datetime.fromisoformat(now["datetime"])
    assert told.utcoffset() is not None and told.utcoffset().total_seconds() == 0
    assert before.replace(microsecond=0) <= told <= datetime.now(UTC)
    paris = one(events, "action_completed", "paris")["result"]
    assert paris["source"]["timezone"] == "UTC" and paris["target"]["timezone"] == "Europe/Paris"
    assert one(events, "response_end")["text"] == f"It is {now['datetime']} in UTC."
    worker = int(one(events, "action_started", "now")["worker"].rpartition(":")[2])
    assert worker in workers["relic"].members()  # MCP tools run on the relic pool


@pytest.mark.parametrize(("params", "problem"), [
    ({"tz": "UTC"}, "'timezone' is a required property"),
    ({"timezone": 5}, "parameter 'timezone': 5 is not of type 'string'"),
])
def test_bad_parameters_are_a_422_before_anything_runs(api: Any, params: dict[str, Any],
                                                        problem: str) -> None:
    before = httpx.get(f"{api.url}/v1/jobs?limit=5", timeout=30).json()["items"]
    response = submit(api, tool("now", "time.get_current_time", params))
    assert response.status_code == 422, response.text
    errors = response.json()["detail"]["errors"]
    assert [e["kind"] for e in errors] == ["invalid_parameters"]
    assert problem in errors[0]["message"]
    after = httpx.get(f"{api.url}/v1/jobs?limit=5", timeout=30).json()["items"]
    assert [j["id"] for j in after] == [j["id"] for j in before]


def test_an_agent_lists_and_calls_an_mcp_tool(api: Any, fake_llm: FakeLLM) -> None:
    model = f"time-{uuid.uuid4().hex[:8]}"
    call = json.dumps({"name": "time.get_current_time", "parameters": {"timezone": "UTC"}})
    fake_llm.script(model, [
        Turn(text=f'<action type="tool" mode="sync" id="now">{call}</action>',
             tokens_per_second=10_000),
        Turn(text='<response final="true">It is $now.datetime.</response>',
             tokens_per_second=10_000),
    ])
    response = httpx.post(f"{api.url}/v1/jobs", json={
        "agent": "clock", "input": "What time is it in UTC?",
        "options": {"model": model}}, timeout=30)
    assert response.status_code == 202, response.text
    events = follow(api, response.json()["id"])
    assert events[-1]["type"] == "job_completed", events[-1]
    now = one(events, "action_completed", "now")["result"]
    system = fake_llm.requests(model)[0]["messages"][0]["content"]
    assert "- time.get_current_time: Get current time in a specific timezone" in system
    assert '"required":["timezone"]' in system
    assert "- faulty.fail: Answer an error result" in system
    assert "time.convert_time" not in system  # not in the agent's tools
    job = httpx.get(f"{api.url}/v1/jobs/{response.json()['id']}", timeout=30).json()
    assert job["result"] == f"It is {now['datetime']}."


def test_a_native_tools_model_calls_an_mcp_tool_by_its_function_name(
        api: Any, fake_llm: FakeLLM) -> None:
    """Providers refuse dots in function names: the tool is offered as
    `time__get_current_time`, and the call is mapped back to `time.get_current_time`."""
    model = f"native-time-{uuid.uuid4().hex[:8]}"
    fake_llm.script(model, [
        Turn(tool_calls=[{"id": "call_now", "name": "time__get_current_time",
                          "arguments": {"timezone": "UTC"}}], tokens_per_second=10_000),
        Turn(text="Done.", tokens_per_second=10_000),
    ])
    response = httpx.post(f"{api.url}/v1/jobs", json={
        "agent": "native_clock", "input": "Time?", "options": {"model": model}}, timeout=30)
    assert response.status_code == 202, response.text
    events = follow(api, response.json()["id"])
    assert events[-1]["type"] == "job_completed", events[-1]
    parsed = one(events, "action_parsed")["action"]
    assert (parsed["id"], parsed["name"]) == ("call_now", "time.get_current_time")
    assert one(events, "action_completed", "call_now")["result"]["timezone"] == "UTC"
    first, second = fake_llm.requests(model)
    assert [t["function"]["name"] for t in first["tools"]] == ["time__get_current_time"]
    assistant = second["messages"][2]
    assert assistant["tool_calls"][0]["function"]["name"] == "time__get_current_time"


# ---------------------------------------------------------------- a server that misbehaves


def test_the_server_is_reused_across_jobs_and_restarted_after_a_crash(api: Any) -> None:
    first = faulty_pid(api)
    assert faulty_pid(api) == first  # one process served both jobs

    events = run(api, tool("boom", "faulty.crash", {"code": 3}))
    failed = one(events, "action_failed", "boom")
    assert failed["status"] == "error"
    assert failed["error"].startswith("MCP server 'faulty' exited with code 3 during tool "
                                      "'crash'; it is restarted on next use")
    assert failed["error"].endswith("crashing on purpose")

    again = faulty_pid(api)  # the next call works: restarted
    assert again != first


def test_an_error_result_is_an_action_error_with_its_message(api: Any) -> None:
    events = run(api, tool("f", "faulty.fail", {"message": "no record 42"}))
    failed = one(events, "action_failed", "f")
    assert failed["status"] == "error"
    assert failed["error"].startswith("MCP tool faulty.fail failed: ")
    assert failed["error"].endswith("no record 42")
    assert events[-1]["type"] == "job_failed"


def test_a_hanging_call_times_out_and_the_server_is_cancelled(api: Any, tmp_path: Path) -> None:
    marker = tmp_path / "hang"
    events = run(api, tool("h", "faulty.hang", {"marker": str(marker)}, timeout=2))
    # the action's 2 s timeout ended it, not the hour's hang: the error names it, and the
    # server was told to cancel the call, which its handler saw
    failed = one(events, "action_failed", "h")
    assert failed["status"] == "timeout"
    assert failed["error"] == ("MCP tool faulty.hang did not answer within 2s; the server was "
                               "sent notifications/cancelled"), failed
    harness.wait_until(lambda: marks(marker) == ["started", "cancelled"], timeout=10,
                       message=lambda: f"marker: {marks(marker)}")
    assert faulty_pid(api) > 0  # the server lives on


def test_cancelling_the_job_cancels_the_call_on_the_server(api: Any, tmp_path: Path) -> None:
    marker = tmp_path / "hang"
    response = submit(api, tool("h", "faulty.hang", {"marker": str(marker)}, timeout=120))
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    harness.wait_until(lambda: marks(marker) == ["started"], timeout=30)
    cancel = httpx.post(f"{api.url}/v1/jobs/{job_id}/cancel", timeout=30)
    assert cancel.status_code in (200, 202), cancel.text
    harness.wait_until(lambda: marks(marker) == ["started", "cancelled"], timeout=10,
                       message=lambda: f"marker: {marks(marker)}")
    events = follow(api, job_id)
    assert events[-1]["type"] == "job_cancelled"
