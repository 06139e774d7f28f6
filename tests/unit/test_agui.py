"""`cortex_api.agui` on synthetic job logs: every Cortex event type, every AG-UI event checked
by the `ag-ui-protocol` package's models, well-formed sequences, and resuming at every seq."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest

from cortex_api.agui import AgUiTranslator
from cortex_api.sse import agui_encoder, event_stream
from tests.agui_checks import assert_well_formed, parse, parse_all
from tests.unit.test_sse_hub import FakeSource

pytestmark = pytest.mark.unit

JOB = "j1"
RUNTIME_MD = Path(__file__).resolve().parents[2] / "docs" / "runtime.md"


def log(*events: tuple[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """A job's log: seq 1, 2, 3…, one second apart."""
    return [{"job_id": JOB, "seq": seq, "ts": 1700000000.0 + seq, "type": kind, "data": data}
            for seq, (kind, data) in enumerate(events, 1)]


def parsed(ident: str, name: str, params: dict[str, Any], kind: str = "tool",
           mode: str = "async", in_thought: bool = False) -> tuple[str, dict[str, Any]]:
    return ("action_parsed", {"action": {
        "id": ident, "type": kind, "mode": mode, "name": name, "parameters": params,
        "output_key": None, "depends_on": [], "timeout": None, "retry": 0, "on_error": "fail",
        "in_thought": in_thought, "generated_id": False, "line": 1, "column": 1}})


def ok(ident: str, result: Any) -> list[tuple[str, dict[str, Any]]]:
    return [("action_queued", {"action_id": ident}),
            ("action_started", {"action_id": ident, "attempt": 1, "worker": "vm:1"}),
            ("action_completed", {"action_id": ident, "status": "ok", "duration_ms": 1.5,
                                  "result": result})]


#: An agent job that thinks, acts (a tool, a child agent after approval, a failing tool that
#: was retried, a skipped and a rejected action, a cancelled fire-and-forget one), restarts a
#: broken stream, and answers with references in its responses.
AGENT = log(
    ("job_queued", {"kind": "agent", "agent": "tester", "parent_job": "p1",
                    "parent_action": "ask", "depth": 1}),
    ("job_started", {"kind": "agent", "agent": "tester"}),
    ("turn_started", {"turn": 1}),
    ("thought_chunk", {"text": "I need "}),
    ("thought_chunk", {"text": "the sum."}),
    parsed("sum", "calculator", {"expression": "19 + 23"}, in_thought=True),
    ("thought_chunk", {"text": " And help."}),
    ("thought_end", {"text": "I need the sum. And help."}),
    ("text", {"text": "\n"}),
    ("context_feed", {"id": "prefs", "value": {"units": "metric"}}),
    parsed("help", "helper", {"task": "check $sum"}, kind="agent", mode="sync"),
    parsed("x", "flaky", {}),
    *ok("sum", 42),
    ("approval_requested", {"action_id": "help", "type": "agent", "name": "helper",
                            "parameters": {"task": "check 42"}, "timeout_s": 60,
                            "expires_at": 1700000100.0}),
    ("action_approved", {"action_id": "help", "by": "api", "reason": None}),
    ("action_queued", {"action_id": "help"}),
    ("action_started", {"action_id": "help", "attempt": 1, "worker": "vm:2"}),
    ("child_job", {"action_id": "help", "job_id": "c1"}),
    ("action_queued", {"action_id": "x"}),
    ("action_started", {"action_id": "x", "attempt": 1, "worker": "vm:1"}),
    ("action_retrying", {"action_id": "x", "attempt": 1, "status": "error", "error": "flaked"}),
    ("action_failed", {"action_id": "x", "status": "error", "duration_ms": 3.0,
                       "error": {"message": "flaked twice"}}),
    ("protocol_error", {"kind": "invalid_json", "message": "bad body", "line": 3, "column": 9,
                        "action_id": None}),
    ("warning", {"kind": "unknown_field", "message": "`foo` ignored", "line": 4, "column": 1,
                 "action_id": "x"}),
    ("response_chunk", {"text": "Checking ", "final": False}),
    ("response_chunk", {"text": "$sum now.", "final": False}),
    ("usage", {"turn": 1, "prompt_tokens": 100, "completion_tokens": 20, "estimated": True}),
    *ok("help", "42 is right"),
    ("response_end", {"final": False, "text": "Checking 42 now."}),
    ("turn_completed", {"turn": 1}),
    ("turn_started", {"turn": 2}),
    ("model_waiting", {"endpoint": "fast-gpt", "reason": "paused", "wait_s": 1.5}),
    ("thought_chunk", {"text": "Hmm, the str"}),
    ("response_chunk", {"text": "half an answer", "final": True}),
    ("warning", {"kind": "model_retry", "message": "the model stream broke; turn restarted"}),
    ("thought_chunk", {"text": "Again: all done."}),
    ("thought_end", {"text": "Again: all done."}),
    ("thought_end", {"text": ""}),
    parsed("y", "echo", {"message": "$x"}),
    ("action_skipped", {"action_id": "y", "reason": "dependency x did not succeed"}),
    parsed("z", "web_scraper", {"url": "https://example.com"}),
    ("approval_requested", {"action_id": "z", "type": "tool", "name": "web_scraper",
                            "parameters": {"url": "https://example.com"}, "timeout_s": 60,
                            "expires_at": 1700000200.0}),
    ("action_rejected", {"action_id": "z", "by": "api", "reason": "not that site"}),
    ("action_failed", {"action_id": "z", "status": "error", "duration_ms": 0.0,
                       "error": "rejected: not that site"}),
    parsed("bg", "sleep", {"seconds": 60}, mode="fire_and_forget"),
    ("action_queued", {"action_id": "bg"}),
    ("feed_updated", {"feed_id": "prefs", "value": {"units": "imperial"}}),
    ("response_chunk", {"text": "The sum is ", "final": True}),
    ("response_chunk", {"text": "$sum (cost: $$5).", "final": True}),
    ("usage", {"turn": 2, "prompt_tokens": 150, "completion_tokens": 30}),
    ("response_end", {"final": True, "text": "The sum is 42 (cost: $5)."}),
    ("action_cancelled", {"action_id": "bg"}),
    ("turn_completed", {"turn": 2}),
    ("job_completed", {"status": "completed", "result": "The sum is 42 (cost: $5).",
                       "error": None, "turns": 2}),
)

#: A document whose response streams at parse time and is rendered at the end; fail_fast.
DOCUMENT = log(
    ("job_queued", {"kind": "document", "actions": 1}),
    ("job_started", {"kind": "document"}),
    parsed("a", "echo", {"message": "A"}),
    ("text", {"text": "\n"}),
    ("response_chunk", {"text": "a=$a", "final": True}),
    *ok("a", "A"),
    ("response_end", {"final": True, "text": "a=A"}),
    ("job_failed", {"status": "failed", "reason": "fail_fast: action b failed"}),
)

#: Cancelled mid-thought and mid-response: both are closed before the run ends.
CANCELLED = log(
    ("job_queued", {"kind": "agent", "agent": "tester"}),
    ("job_started", {"kind": "agent", "agent": "tester"}),
    ("turn_started", {"turn": 1}),
    ("response_chunk", {"text": "Partial $x answer", "final": True}),
    ("thought_chunk", {"text": "Still thinking"}),
    ("some_future_event", {"what": "a type this module does not know yet"}),
    ("job_cancelled", {"status": "cancelled", "reason": "cancelled by the user"}),
)

LOGS = {"agent": AGENT, "document": DOCUMENT, "cancelled": CANCELLED}


def translate(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Each Cortex event's AG-UI events, from one translator."""
    translator = AgUiTranslator(JOB)
    return [translator(event) for event in events]


def flat(groups: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [item for group in groups for item in group]


def documented_types() -> set[str]:
    """The event types docs/runtime.md#events lists (its tables, and `feed_updated`)."""
    text = RUNTIME_MD.read_text()
    section = text[text.index("\n## Events"):text.index("\n## Modes")]
    return set(re.findall(r"^\| `([a-z_]+)`", section, re.MULTILINE)) | {"feed_updated"}


def test_the_logs_hold_every_documented_event_type() -> None:
    seen = {event["type"] for events in LOGS.values() for event in events}
    missing = documented_types() - seen
    assert not missing and len(documented_types()) >= 28, missing


@pytest.mark.parametrize("name", list(LOGS))
def test_every_event_is_valid_ag_ui_and_the_sequence_is_well_formed(name: str) -> None:
    events = flat(translate(LOGS[name]))
    parse_all(events)
    assert_well_formed(events)
    assert all(e["timestamp"] % 1000 == 0 and e["timestamp"] > 1.7e12 for e in events)


@pytest.mark.parametrize("name", list(LOGS))
def test_nothing_is_silently_dropped(name: str) -> None:
    """Each Cortex event becomes AG-UI events, except response chunks held back for their
    references (the rendered text carries them) and closing events that close nothing."""
    for event, out in zip(LOGS[name], translate(LOGS[name]), strict=True):
        held = event["type"] == "response_chunk" and event["data"]["text"].startswith("$")
        assert out or held, event


def test_the_run_opens_and_ends_with_the_job() -> None:
    groups = translate(AGENT)
    assert groups[0] == [{"type": "RUN_STARTED", "threadId": JOB, "runId": JOB,
                          "parentRunId": "p1", "rawEvent": AGENT[0],
                          "timestamp": 1700000001000}]
    finished = groups[-1][-1]
    assert finished["type"] == "RUN_FINISHED" and finished["result"] == "The sum is 42 (cost: $5)."
    assert finished["usage"] == [{"inputTokens": 250, "outputTokens": 50, "totalTokens": 300}]
    assert "outcome" not in finished  # absent means success
    error = flat(translate(DOCUMENT))[-1]
    assert (error["type"], error["message"], error["code"]) == (
        "RUN_ERROR", "fail_fast: action b failed", "job_failed")
    cancelled = flat(translate(CANCELLED))[-1]
    assert cancelled["type"] == "RUN_FINISHED" and cancelled["outcome"] == {"type": "cancelled"}
    assert AgUiTranslator(JOB, thread_id="s1")(AGENT[0])[0]["threadId"] == "s1"


def test_turns_are_steps() -> None:
    steps = [(e["type"], e["stepName"]) for e in flat(translate(AGENT)) if "stepName" in e]
    assert steps == [("STEP_STARTED", "turn 1"), ("STEP_FINISHED", "turn 1"),
                     ("STEP_STARTED", "turn 2"), ("STEP_FINISHED", "turn 2")]


def test_thoughts_are_reasoning_messages_streamed_as_they_arrive() -> None:
    groups = translate(AGENT)
    first = "j1:thought:4"
    assert [(e["type"], e.get("delta")) for e in groups[3]] == [
        ("REASONING_START", None), ("REASONING_MESSAGE_START", None),
        ("REASONING_MESSAGE_CONTENT", "I need ")]
    assert {e["messageId"] for e in groups[3]} == {first}
    assert groups[4] == [{"type": "REASONING_MESSAGE_CONTENT", "messageId": first,
                          "delta": "the sum.", "timestamp": 1700000005000}]
    # an action written in the thought does not end it
    assert [e["type"] for e in groups[6]] == ["REASONING_MESSAGE_CONTENT"]
    assert [(e["type"], e["messageId"]) for e in groups[7]] == [
        ("REASONING_MESSAGE_END", first), ("REASONING_END", first)]
    # a thought that streamed nothing comes whole at its end; an empty one still opens
    [empty] = [g for e, g in zip(AGENT, groups, strict=True)
               if e["type"] == "thought_end" and not e["data"]["text"]]
    assert [e["type"] for e in empty] == ["REASONING_START", "REASONING_MESSAGE_START",
                                          "REASONING_MESSAGE_END", "REASONING_END"]
    reasoning = "".join(e["delta"] for e in flat(groups)
                        if e["type"] == "REASONING_MESSAGE_CONTENT")
    assert reasoning == "I need the sum. And help.Hmm, the strAgain: all done."


def test_every_action_is_a_tool_call_answered_by_its_outcome() -> None:
    events = flat(translate(AGENT))
    starts = {e["toolCallId"]: e for e in events if e["type"] == "TOOL_CALL_START"}
    assert {call: e["toolCallName"] for call, e in starts.items()} == {
        "j1:sum": "calculator", "j1:help": "helper", "j1:x": "flaky", "j1:y": "echo",
        "j1:z": "web_scraper", "j1:bg": "sleep"}
    assert starts["j1:help"]["rawEvent"]["data"]["action"]["type"] == "agent"
    args = {e["toolCallId"]: json.loads(e["delta"]) for e in events if e["type"] == "TOOL_CALL_ARGS"}
    assert args["j1:help"] == {"task": "check $sum"}  # as written: approval shows them filled
    results = {e["toolCallId"]: e["content"] for e in events if e["type"] == "TOOL_CALL_RESULT"}
    assert results == {"j1:sum": "42", "j1:help": "42 is right",
                       "j1:x": 'error: {"message": "flaked twice"}',
                       "j1:y": "skipped: dependency x did not succeed",
                       "j1:z": "error: rejected: not that site",
                       "j1:bg": "cancelled: the job ended first"}
    result = next(e for e in events if e["type"] == "TOOL_CALL_RESULT")
    assert result["messageId"] == "j1:sum:result" and result["rawEvent"]["data"]["duration_ms"]


def test_approvals_and_what_has_no_equivalent_are_custom_events() -> None:
    events = flat(translate(AGENT + CANCELLED[-2:-1]))
    custom = [(e["name"], e["value"]) for e in events if e["type"] == "CUSTOM"]
    names = [name for name, _ in custom]
    assert names == [f"cortex.{kind}" for kind in (
        "job_started", "text", "context_feed", "action_queued", "action_started",
        "approval_requested", "action_approved", "action_queued", "action_started", "child_job",
        "action_queued", "action_started", "action_retrying", "protocol_error", "warning",
        "usage", "action_queued", "action_started", "model_waiting", "warning",
        "approval_requested", "action_rejected", "action_queued", "feed_updated", "usage",
        "some_future_event")]
    assert custom[5][1]["parameters"] == {"task": "check 42"}


def test_responses_stream_up_to_a_reference_and_end_with_their_rendered_text() -> None:
    groups = translate(AGENT)
    by_seq = {event["seq"]: group for event, group in zip(AGENT, groups, strict=True)}
    chunk, held, end = (next(e["seq"] for e in AGENT if e["type"] == kind
                             and e["data"].get("text", "").startswith(start))
                        for kind, start in (("response_chunk", "Checking"),
                                            ("response_chunk", "$sum now"),
                                            ("response_end", "Checking")))
    message = f"j1:response:{chunk}"
    assert [(e["type"], e.get("delta")) for e in by_seq[chunk]] == [
        ("TEXT_MESSAGE_START", None), ("TEXT_MESSAGE_CONTENT", "Checking ")]
    assert by_seq[held] == []  # `$sum` waits for its value
    assert [(e["type"], e["messageId"], e.get("delta")) for e in by_seq[end]] == [
        ("TEXT_MESSAGE_CONTENT", message, "42 now."), ("TEXT_MESSAGE_END", message, None)]
    assert by_seq[end][-1]["rawEvent"]["data"]["final"] is False
    texts: dict[str, str] = {}
    for e in flat(groups):
        if e["type"] == "TEXT_MESSAGE_CONTENT":
            texts[e["messageId"]] = texts.get(e["messageId"], "") + e["delta"]
    # the broken stream's half answer ends as written; the rendered ones as rendered
    assert list(texts.values()) == ["Checking 42 now.", "half an answer",
                                    "The sum is 42 (cost: $5)."]


def test_a_response_that_never_streamed_is_a_message_of_its_own() -> None:
    events = log(("job_queued", {"kind": "agent", "agent": "tools"}),
                 ("response_end", {"final": True, "text": "Plain answer."}),
                 ("job_completed", {"status": "completed", "result": "Plain answer.",
                                    "error": None, "turns": 1}))
    out = flat(translate(events))
    assert [(e["type"], e.get("delta")) for e in out[1:4]] == [
        ("TEXT_MESSAGE_START", None), ("TEXT_MESSAGE_CONTENT", "Plain answer."),
        ("TEXT_MESSAGE_END", None)]
    assert out[1]["messageId"] == "j1:response:2" and out[1]["role"] == "assistant"


def test_a_rendered_text_that_does_not_continue_the_stream_keeps_both() -> None:
    """Two responses with nothing between them log as one run of chunks: the first rendered
    text does not continue it, so the streamed text ends as written and each rendered
    response is a message of its own. Nothing is lost."""
    events = log(("job_queued", {"kind": "document", "actions": 0}),
                 ("response_chunk", {"text": "onetwo", "final": True}),
                 ("response_end", {"final": True, "text": "one"}),
                 ("response_end", {"final": True, "text": "two"}),
                 ("job_completed", {"status": "completed", "result": "two", "error": None,
                                    "duration_ms": 1.0}))
    out = flat(translate(events))
    assert_well_formed(out)
    contents = [(e["messageId"], e["delta"]) for e in out if e["type"] == "TEXT_MESSAGE_CONTENT"]
    assert contents == [("j1:response:2", "onetwo"), ("j1:response:3", "one"),
                        ("j1:response:4", "two")]


def test_an_action_parsed_again_is_one_tool_call() -> None:
    """A turn taken over from a dead coordinator may log its actions again."""
    events = log(("job_queued", {"kind": "agent", "agent": "tester"}),
                 parsed("a", "echo", {"message": "hi"}),
                 ("warning", {"kind": "turn_restarted", "turn": 1, "message": "taken over"}),
                 parsed("a", "echo", {"message": "hi"}),
                 *ok("a", "hi"),
                 ("job_completed", {"status": "completed", "result": "", "error": None,
                                    "turns": 1}))
    groups = translate(events)
    assert [e["type"] for e in groups[3]] == ["CUSTOM"]
    assert groups[3][0]["name"] == "cortex.action_parsed"
    assert_well_formed(flat(groups))


@pytest.mark.parametrize("name", list(LOGS))
def test_a_translator_resumed_after_any_seq_goes_on_as_the_unbroken_one(name: str) -> None:
    """What a stream resuming after seq N writes: a fresh translator reads 1..N first."""
    events = LOGS[name]
    unbroken = translate(events)
    for n in range(len(events) + 1):
        translator = AgUiTranslator(JOB)
        for event in events[:n]:
            translator(event)
        assert [translator(event) for event in events[n:]] == unbroken[n:], n


def sse(messages: str) -> list[tuple[int, dict[str, Any]]]:
    """(id, AG-UI event) of each SSE message; each must have an id and data, nothing else."""
    out = []
    for block in messages.split("\n\n")[:-1]:
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        assert set(fields) == {"id", "data"}, block
        parse(fields["data"])
        out.append((int(fields["id"]), json.loads(fields["data"])))
    return out


def test_the_stream_resumed_after_any_seq_neither_repeats_nor_loses_an_event() -> None:
    """Through `agui_encoder` and `event_stream`: every AG-UI event carries its Cortex event's
    seq as SSE `id`; after `Last-Event-ID: N` the stream is the unbroken one's tail."""

    async def stream(after: int) -> list[tuple[int, dict[str, Any]]]:
        source = FakeSource(AGENT, status="completed")
        encode = await agui_encoder(source, JOB, after)
        return sse("".join([m async for m in event_stream(source, JOB, after, encode=encode)]))

    whole = asyncio.run(stream(0))
    assert [event for _, event in whole] == flat(translate(AGENT))
    ids = [seq for seq, _ in whole]
    assert ids == sorted(ids) and set(ids) < {e["seq"] for e in AGENT}
    for n in range(len(AGENT) + 1):
        assert asyncio.run(stream(n)) == [(seq, e) for seq, e in whole if seq > n], n


def test_history_reads_only_up_to_the_resume_point() -> None:
    source = FakeSource(AGENT, status="completed")
    asyncio.run(agui_encoder(source, JOB, 7))
    assert source.calls == ["read>0"]


def test_a_turn_continued_after_a_takeover_is_one_reasoning_message() -> None:
    """A takeover that continues the partial answer (`continued`) does not start over: the
    reasoning message open at the takeover goes on, and its text reads as one."""
    events = log(("job_queued", {"kind": "agent", "agent": "continuer"}),
                 ("turn_started", {"turn": 1}),
                 ("thought_chunk", {"text": "Thinking with "}),
                 ("warning", {"kind": "turn_restarted", "turn": 1, "continued": True,
                              "message": "taken over; it goes on"}),
                 ("thought_chunk", {"text": "care."}),
                 ("thought_end", {"text": "Thinking with care."}),
                 ("job_completed", {"status": "completed", "result": "", "error": None,
                                    "turns": 1}))
    out = flat(translate(events))
    assert_well_formed(out)
    starts = [e for e in out if e["type"].endswith("_MESSAGE_START") and "REASONING" in e["type"]]
    assert len(starts) == 1
    text = "".join(e["delta"] for e in out if e["type"].startswith("REASONING")
                   and e["type"].endswith("_CONTENT"))
    assert text == "Thinking with care."
