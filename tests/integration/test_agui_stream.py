"""`GET /v1/jobs/{id}/events?format=ag-ui` against the real API and workers: an agent job that
thinks, runs actions and answers, read live as AG-UI events (each checked by the
`ag-ui-protocol` package), dropped mid-job while a thought is open, and resumed with
`Last-Event-ID`: the two parts are the whole stream, nothing lost, nothing repeated."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests import harness
from tests.agui_checks import assert_well_formed, parse
from tests.fake_llm import FakeLLM
from tests.integration.test_agents import act, final, start, turn, unique, view

Message = tuple[int, dict[str, Any]]  # SSE id, AG-UI event


@pytest.fixture
def api(workers: Any, api: harness.Process) -> harness.Process:
    return api


def read(api: harness.Process, job_id: str, after: int | None = None,
         until: Any = None) -> list[Message]:
    """The AG-UI stream's messages, to its end; with `until(messages)`, the connection is
    dropped at the first message of the seq after the one that made it true."""
    headers = {"Last-Event-ID": str(after)} if after is not None else {}
    out: list[Message] = []
    fields: dict[str, str] = {}
    with httpx.stream("GET", f"{api.url}/v1/jobs/{job_id}/events?format=ag-ui",
                      headers=headers, timeout=30) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line:
                name, _, value = line.partition(": ")
                assert name in ("id", "data") and name not in fields, line
                fields[name] = value
                continue
            if not fields:
                continue  # the end of a keep-alive comment
            message = (int(fields["id"]), json.loads(fields["data"]))
            parse(fields["data"])
            fields = {}
            if until is not None and out and message[0] != out[-1][0] and until(out):
                return out
            out.append(message)
    return out


def test_an_agent_job_as_ag_ui_events_resumed_mid_job(api: harness.Process,
                                                       fake_llm: FakeLLM) -> None:
    model = unique("agui")
    fake_llm.script(model, [
        # a sync action inside the thought cuts the stream: the thought stays open until the
        # turn ends, a second later (the nap)
        turn("<thought>Let me rest first. " + act("nap", "sleep", {"seconds": 1.0})),
        turn("<thought>Rested. Now the sum.</thought>\n"
             + act("sum", "calculator", {"expression": "19 + 23"}, mode="async") + "\n"
             + final("The sum is $sum.")),
    ])
    job_id = start(api, "tester", "Rest, then add 19 and 23.", model=model)

    def napping(messages: list[Message]) -> bool:
        return any(e["type"] == "TOOL_CALL_START" and e["toolCallId"] == f"{job_id}:nap"
                   for _, e in messages)

    first = read(api, job_id, until=napping)
    assert view(api, job_id)["status"] == "running", "dropped too late: the job has ended"
    resumed = read(api, job_id, after=first[-1][0])
    whole = read(api, job_id)

    assert first + resumed == whole
    events = [event for _, event in whole]
    assert_well_formed(events)
    ids = [seq for seq, _ in whole]
    assert ids == sorted(ids)
    # the thought open at the drop is closed by the resumed stream, under the same id
    opened = [e["messageId"] for _, e in first if e["type"] == "REASONING_MESSAGE_START"]
    closed = [e["messageId"] for _, e in resumed if e["type"] == "REASONING_MESSAGE_END"]
    assert opened and opened[0] == closed[0]

    def texts(kind: str) -> list[str]:
        out: dict[str, str] = {}
        for e in events:
            if e["type"] == kind:
                out[e["messageId"]] = out.get(e["messageId"], "") + e["delta"]
        return list(out.values())

    assert texts("REASONING_MESSAGE_CONTENT") == ["Let me rest first. ", "Rested. Now the sum."]
    assert texts("TEXT_MESSAGE_CONTENT") == ["The sum is 42."]
    calls = [(e["toolCallName"], e["toolCallId"]) for e in events if e["type"] == "TOOL_CALL_START"]
    assert calls == [("sleep", f"{job_id}:nap"), ("calculator", f"{job_id}:sum")]
    results = {e["toolCallId"]: e["content"] for e in events if e["type"] == "TOOL_CALL_RESULT"}
    assert results[f"{job_id}:sum"] == "42" and set(results) == {c for _, c in calls}
    assert [e["stepName"] for e in events if e["type"] == "STEP_STARTED"] == ["turn 1", "turn 2"]
    assert events[0]["runId"] == events[-1]["runId"] == job_id
    assert events[-1]["type"] == "RUN_FINISHED" and events[-1]["result"] == "The sum is 42."
    assert events[-1]["usage"][0]["totalTokens"] > 0


def test_an_unknown_format_is_a_400(api: harness.Process) -> None:
    response = httpx.get(f"{api.url}/v1/jobs/nope/events?format=ag_ui", timeout=10)
    assert response.status_code == 400
    assert response.json()["detail"] == {
        "message": "unknown format 'ag_ui': use one of cortex, ag-ui",
        "formats": ["cortex", "ag-ui"]}
