"""An agent on Anthropic's Messages API end to end: API → agent pool → the fake Anthropic
server (`tests/fake_anthropic.py`, the session fixture `fake_anthropic`, reached by the
`claude_tester` agent through `${CORTEX_TEST_ANTHROPIC_URL}`) → the tool pool → back.

Each test scripts the server under a model name of its own (the job option `model`), and
checks the job's events and what the server received: the Messages API requests Cortex
built from its conversation (`system` apart, `tool_use` blocks, `tool_result` blocks).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.fake_anthropic import FakeAnthropic, Turn
from tests.integration.test_agents import FAST, run_agent, seq, unique, view
from tests.integration.test_documents import of, one

AGENT = "claude_tester"


@pytest.fixture
def api(workers: Any, api: Any) -> Any:  # every test here needs the pools running
    return api


@pytest.fixture
def claude(fake_anthropic: FakeAnthropic) -> Iterator[FakeAnthropic]:
    yield fake_anthropic


def turn(text: str = "", **fields: Any) -> Turn:
    fields.setdefault("tokens_per_second", FAST)
    return Turn(text=text, **fields)


def test_a_claude_agent_calls_two_tools_at_once_then_answers_in_plain_text(
        api: Any, claude: FakeAnthropic) -> None:
    model = unique("claude")
    claude.script(model, [
        # 2 characters per event at 20 events/s: the calculator's input takes about 0.6 s
        turn("<thought>Both at once.</thought>", tool_calls=[
            {"id": "toolu_echo", "name": "echo", "arguments": {"message": "ping"}},
            {"id": "toolu_calc", "name": "calculator", "arguments": {"expression": "6*7"}}],
             chunk_chars=2, tokens_per_second=20),
        turn("The echo said ping, and 6*7 is 42."),
    ])

    job_id, events = run_agent(api, AGENT, "Ping and multiply.", model=model)

    job = view(api, job_id)
    assert (job["status"], job["result"]) == ("completed", "The echo said ping, and 6*7 is 42.")
    assert of(events, "response_end")[-1]["data"] == {
        "final": True, "text": "The echo said ping, and 6*7 is 42."}
    parsed = {e["data"]["action"]["id"]: e for e in of(events, "action_parsed")}
    assert [(a["id"], a["type"], a["mode"], a["name"], a["parameters"])
            for a in (e["data"]["action"] for e in parsed.values())] == [
        ("toolu_echo", "tool", "async", "echo", {"message": "ping"}),
        ("toolu_calc", "tool", "async", "calculator", {"expression": "6*7"})]
    # the first call was dispatched at its block's end: it reached the tool pool while Claude
    # was still writing the second call's input
    assert seq(events, "action_queued", "toolu_echo") < parsed["toolu_calc"]["seq"]
    assert seq(events, "action_started", "toolu_echo") < parsed["toolu_calc"]["seq"]
    assert {a["id"]: (a["status"], a["depends_on"]) for a in job["actions"]} == {
        "toolu_echo": ("ok", []), "toolu_calc": ("ok", [])}

    first, second = claude.requests(model)
    assert claude.remaining(model) == 0
    # the system prompt is the top-level `system`, never a message
    assert isinstance(first["system"], str) and first["system"]
    assert second["system"] == first["system"]
    assert all(m["role"] in ("user", "assistant") for r in (first, second) for m in r["messages"])
    assert first["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Ping and multiply."}]}]
    assert [(t["name"], t["input_schema"]["type"], t["eager_input_streaming"])
            for t in first["tools"]] == [("echo", "object", True), ("calculator", "object", True)]
    assert first["stream"] is True and first["max_tokens"] > 0
    # the conversation as Claude was trained on it: its tool_use blocks, then one user message
    # of tool_result blocks, in call order
    assert second["messages"] == [
        first["messages"][0],
        {"role": "assistant", "content": [
            {"type": "text", "text": "<thought>Both at once.</thought>"},
            {"type": "tool_use", "id": "toolu_echo", "name": "echo",
             "input": {"message": "ping"}},
            {"type": "tool_use", "id": "toolu_calc", "name": "calculator",
             "input": {"expression": "6*7"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_echo", "content": "ping"},
            {"type": "tool_result", "tool_use_id": "toolu_calc", "content": "42"}]},
    ]
    assert all(h["anthropic-version"] == "2023-06-01" for h in claude.request_headers(model))
    assert claude.outcomes(model) == ["complete", "complete"]


def test_an_invalid_tool_input_is_fed_back_as_an_error_result(
        api: Any, claude: FakeAnthropic) -> None:
    """Fine-grained tool streaming may end a tool input mid-JSON: the call becomes an error
    `tool_result` and the parser's error reaches the model in the same user message."""
    model = unique("claude-bad")
    claude.script(model, [
        turn(tool_calls=[{"id": "toolu_bad", "name": "echo",
                          "arguments": '{"message": "unterminated'}]),
        turn("Sorry, I could not echo that."),
    ])

    job_id, events = run_agent(api, AGENT, "Echo something.", model=model)

    assert view(api, job_id)["status"] == "completed"
    assert one(events, "protocol_error")["data"]["kind"] == "invalid_json"
    assert not of(events, "action_parsed")
    second = claude.requests(model)[1]
    assert second["messages"][1] == {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_bad", "name": "echo",
         "input": {"INVALID_JSON": '{"message": "unterminated'}}]}
    result, feedback = second["messages"][2]["content"]
    assert result["type"] == "tool_result" and result["tool_use_id"] == "toolu_bad"
    assert result["is_error"] is True and result["content"].startswith("error: ")
    assert feedback["type"] == "text" and "invalid_json" in feedback["text"]
