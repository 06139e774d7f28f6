"""Agent jobs end to end: API → agent pool (one task per turn) → the fake model server → pools.

Every test scripts the fake OpenAI-compatible server (`tests/fake_llm.py`, the session fixture
`fake_llm`) under a model name of its own, passed as the job option `model`, so tests never
share a script queue. Child jobs of `type="agent"` actions run the `helper` agent, whose model
name is `helper`; tests that use it leave that queue empty (`remaining == 0`).

Assertions are on the job's event log (types in `seq` order, and their data) and on what the
fake server recorded: the request bodies (the prompts the model saw), how each request ended
(`outcomes`), and when each text chunk was written (`stream_log`).
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from cortex_api.client import Client
from cortex_worker.agents.prompt import PROTOCOL_REMINDER
from tests import harness
from tests.fake_llm import FakeLLM, Turn
from tests.integration.test_documents import follow, of, one
from tests.integration.test_metrics import quiet_scrape, scrape, value
from tests.manifest_helpers import TEST_AGENTS

FAST = 2000.0  # tokens per second (of 4 characters): a turn streams in a few milliseconds
CHUNKS = {"thought_chunk", "response_chunk", "text"}
ENDED = {"completed", "failed", "cancelled"}
TESTER_TOOLS = "echo, sleep, calculator, fail, flaky, web_scraper, python, deploy"


# ------------------------------------------------------------------------------ helpers


def unique(tag: str) -> str:
    """A model name no other test uses: the fake server keeps one script queue per name."""
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def act(ident: str, name: str, params: dict[str, Any], mode: str = "sync",
        kind: str = "tool") -> str:
    body = json.dumps({"name": name, "parameters": params})
    return f'<action type="{kind}" mode="{mode}" id="{ident}">{body}</action>'


def final(text: str) -> str:
    return f'<response final="true">{text}</response>'


def turn(text: str = "", **fields: Any) -> Turn:
    fields.setdefault("tokens_per_second", FAST)
    return Turn(text=text, **fields)


def start(api: Any, agent: str, text: str, **options: Any) -> str:
    response = httpx.post(f"{api.url}/v1/jobs", json={"agent": agent, "input": text,
                                                      "options": options}, timeout=30)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def view(api: Any, job_id: str) -> dict[str, Any]:
    response = httpx.get(f"{api.url}/v1/jobs/{job_id}", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def wait_ended(api: Any, job_id: str, timeout: float = 30) -> dict[str, Any]:
    """Poll the job until it ends (an SSE stream would wait forever on a stuck job)."""
    return harness.wait_until(
        lambda: (lambda j: j if j["status"] in ENDED else None)(view(api, job_id)),
        timeout=timeout, interval=0.05,
        message=lambda: f"job {job_id} did not end within {timeout}s: {view(api, job_id)}")


def finish(api: Any, job_id: str, timeout: float = 30) -> list[dict[str, Any]]:
    """Wait until the job ends, then read its whole event log over SSE."""
    wait_ended(api, job_id, timeout)
    events = follow(api, job_id)
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    return events


def run_agent(api: Any, agent: str, text: str, **options: Any) -> tuple[str, list[dict[str, Any]]]:
    job_id = start(api, agent, text, **options)
    return job_id, finish(api, job_id)


def types(events: list[dict[str, Any]], *, chunks: bool = True) -> list[str]:
    """Event types in seq order; runs of one text-chunk type count once (their number depends
    on how the stream was cut), or are left out with `chunks=False`."""
    out: list[str] = []
    for event in events:
        kind = event["type"]
        if kind in CHUNKS and (not chunks or (out and out[-1] == kind)):
            continue
        out.append(kind)
    return out


def text_of(events: list[dict[str, Any]], kind: str) -> str:
    return "".join(e["data"]["text"] for e in of(events, kind))


def seq(events: list[dict[str, Any]], kind: str, action: str | None = None) -> int:
    return one(events, kind, action)["seq"]


def worker_pid(event: dict[str, Any]) -> int:
    """The pid in an `action_started` event's `worker` (`host:pid`)."""
    return int(event["data"]["worker"].rpartition(":")[2])


def messages(llm: FakeLLM, model: str, index: int) -> list[dict[str, Any]]:
    """The chat messages of the model's `index`-th request, without the system prompt."""
    request = llm.requests(model)[index]
    assert request["messages"][0]["role"] == "system"
    return request["messages"][1:]


@pytest.fixture
def api(workers: Any, api: Any) -> Any:  # every test here needs the pools running
    return api


@pytest.fixture
def llm(fake_llm: FakeLLM) -> Iterator[FakeLLM]:
    yield fake_llm
    # the `helper` queue is shared by every test that runs a child job: leave it empty
    assert fake_llm.remaining("helper") == 0, "helper turns left unused"


# ------------------------------------------------------------------------------ streaming


def test_an_action_in_a_thought_starts_while_the_model_is_still_thinking(
        api: Any, llm: FakeLLM) -> None:
    """An async action written early in a long thought starts and finishes before the model
    has even written `</thought>`.

    The fake server writes the thought up to just past the action's `</action>`, then holds
    the rest of its stream until the test has seen `action_completed` on the job's event
    stream (read with the project's client), and notes how much it had written then. So the
    proof is the order of events, never the clock: the action ran while the model was held
    mid-thought, and the whole filler streamed after it.
    """
    model = unique("thought")
    head = "<thought>I will start the lookup right away. "
    early = act("early", "echo", {"message": "pong"}, mode="async")
    filler = "While it runs I keep reasoning about the rest of the task, slowly. " * 4
    text = f"{head}{early}{filler}</thought>{final('The lookup said $early.')}"
    closed = text.index(early) + len(early)  # the characters up to `</action>`
    release = threading.Event()
    llm.script(model, [turn(text, chunk_chars=8, holds={(closed - 1) // 8: release})])

    job_id = start(api, "tester", "Look it up.", model=model)
    written_when_completed: list[int] = []
    with Client(api.url) as client:
        for event in client.events(job_id, timeout=30):
            if event.type == "action_completed" and event.data.get("action_id") == "early":
                (log,) = llm.stream_log(model)
                written_when_completed.append(log[-1][1])
                release.set()
    events = finish(api, job_id)

    assert types(events, chunks=False) == [
        "job_queued", "job_started", "turn_started", "action_parsed", "action_queued",
        "action_started", "action_completed", "thought_end", "usage", "response_end",
        "turn_completed", "job_completed"]
    parsed = one(events, "action_parsed")["data"]["action"]
    assert (parsed["id"], parsed["mode"], parsed["in_thought"]) == ("early", "async", True)
    started, completed = one(events, "action_started", "early"), one(events, "action_completed", "early")
    assert completed["data"]["result"] == "pong"
    thought_end = one(events, "thought_end")
    last_chunk = of(events, "thought_chunk")[-1]
    assert started["seq"] < completed["seq"] < last_chunk["seq"] < thought_end["seq"]
    assert thought_end["data"]["text"] == text_of(events, "thought_chunk") == \
        "I will start the lookup right away. " + filler
    # the action started inside the filler: most of the thought streamed after it
    after = text_of([e for e in events if e["seq"] > started["seq"]], "thought_chunk")
    assert filler.endswith(after) and len(after) > len(filler) / 2

    # the fake server's own record: when the action had completed, it was still holding the
    # stream just past `</action>`, and it wrote the rest (filler, `</thought>`, answer) after
    (written,) = written_when_completed
    assert closed <= written < closed + 8
    assert llm.stream_log(model)[0][-1][1] == len(text)
    assert llm.outcomes(model) == ["complete"]
    assert events[-1]["data"]["result"] == "The lookup said pong."
    assert view(api, job_id)["result"] == "The lookup said pong."


def test_a_sync_action_ends_the_generation_at_its_close_tag(api: Any, llm: FakeLLM) -> None:
    """What the model writes after a sync action's `</action>` is never read: the runtime
    closes the connection, runs the action, and the next turn carries its result."""
    model = unique("sync")
    head = "<thought>I need the sum before anything else.</thought>\n"
    calc = act("sum", "calculator", {"expression": "19 + 23"})
    tail = ("<thought>NEVER-STREAMED: a model that goes on after a sync action is cut off."
            + " More words the runtime must not read." * 20 + "</thought>"
            + final("NEVER-STREAMED wrong answer"))
    llm.script(model, [
        # 200 tokens/s of 4 characters: the tail would take another second to stream
        Turn(text=head + calc + tail, tokens_per_second=200),
        turn(final("The sum is $sum.")),
    ])

    job_id, events = run_agent(api, "tester", "Add 19 and 23.", model=model)

    running = {"action_started", "action_completed"}  # the action runs while the turn closes
    assert types([e for e in events if e["type"] not in running]) == [
        "job_queued", "job_started", "turn_started", "thought_chunk", "thought_end", "text",
        "action_parsed", "action_queued", "usage",
        "turn_completed", "turn_started", "response_chunk", "usage", "response_end",
        "turn_completed", "job_completed"]
    assert seq(events, "action_completed", "sum") < of(events, "turn_completed")[0]["seq"]
    # the endpoint never sent the cut turn's counts: they are estimated, and say so
    cut, last = [e["data"] for e in of(events, "usage")]
    assert cut["estimated"] is True and "estimated" not in last
    assert 0 < cut["completion_tokens"] < len(head + calc + tail) // 4
    assert cut["prompt_tokens"] > 0
    assert all("NEVER" not in json.dumps(e) for e in events)
    assert one(events, "action_completed", "sum")["data"]["result"] == 42
    # the server saw the client go away long before the end of the text
    assert llm.outcomes(model) == ["client_disconnected", "complete"]
    sent = llm.stream_log(model)[0][-1][1]
    assert sent < len(head + calc + tail) - 200
    # the next prompt: the cut assistant turn, then the result
    assert messages(llm, model, 1) == [
        {"role": "user", "content": "Add 19 and 23."},
        {"role": "assistant", "content": head + calc},
        {"role": "user", "content": '<result id="sum" status="ok">42</result>'},
    ]
    assert one(events, "response_end")["data"] == {"final": True, "text": "The sum is 42."}
    assert view(api, job_id)["result"] == "The sum is 42."


def test_non_final_responses_then_a_final_one(api: Any, llm: FakeLLM) -> None:
    model = unique("progress")
    llm.script(model, [
        turn('<response final="false">Computing $c1 first.</response>'
             + act("c1", "calculator", {"expression": "6 * 7"}, mode="async")),
        turn('<response final="false">Got $c1; now checking it with ${c2}.</response>'
             + act("c2", "echo", {"message": "$c1"}, mode="async")),
        turn(final("Final: $c1 (checked: $c2).")),
    ])

    job_id, events = run_agent(api, "tester", "Compute 6*7 and check it.", model=model)

    # async actions run while the turn ends (so `usage` may come before or after them)
    running = {"action_started", "action_completed"}
    assert types([e for e in events if e["type"] not in running]) == [
        "job_queued", "job_started",
        "turn_started", "response_chunk", "action_parsed", "action_queued", "usage",
        "response_end", "turn_completed",
        "turn_started", "response_chunk", "action_parsed", "action_queued", "usage",
        "response_end", "turn_completed",
        "turn_started", "response_chunk", "usage", "response_end", "turn_completed",
        "job_completed"]
    ends = [e["seq"] for e in of(events, "turn_completed")]
    for ident, end in (("c1", ends[0]), ("c2", ends[1])):
        assert (seq(events, "action_queued", ident) < seq(events, "action_started", ident)
                < seq(events, "action_completed", ident) < end)
    assert [e["data"] for e in of(events, "response_end")] == [
        {"final": False, "text": "Computing 42 first."},
        {"final": False, "text": "Got 42; now checking it with 42."},
        {"final": True, "text": "Final: 42 (checked: 42)."},
    ]
    assert [e["data"]["turn"] for e in of(events, "turn_completed")] == [1, 2, 3]
    assert [e["data"]["turn"] for e in of(events, "turn_started")] == [1, 2, 3]
    # the response streamed as written; only response_end renders it
    first_turn = [e for e in events if e["seq"] < of(events, "turn_completed")[0]["seq"]]
    assert text_of(first_turn, "response_chunk") == "Computing $c1 first."
    job = view(api, job_id)
    assert events[-1]["data"] == {"status": "completed", "result": "Final: 42 (checked: 42).",
                                  "error": None, "turns": 3, "usage": job["usage"]}
    assert [u["requests"] for u in job["usage"].values()] == [3]  # one per turn
    assert (job["status"], job["result"]) == ("completed", "Final: 42 (checked: 42).")
    assert messages(llm, model, 2)[-1] == {
        "role": "user", "content": '<result id="c2" status="ok">42</result>'}


# ------------------------------------------------------------------------------ limits and feedback


def test_max_turns_ends_the_job(api: Any, llm: FakeLLM) -> None:
    model = unique("turns")
    llm.script(model, [turn(f"<thought>Step {i}.</thought>" + act(f"s{i}", "echo", {"message": i}))
                       for i in range(1, 6)])

    job_id, events = run_agent(api, "tester", "Never finish.", model=model)

    assert [e["data"]["turn"] for e in of(events, "turn_started")] == [1, 2, 3, 4]
    assert [e["data"]["turn"] for e in of(events, "turn_completed")] == [1, 2, 3, 4]
    assert [e["data"]["action_id"] for e in of(events, "action_completed")] == ["s1", "s2", "s3", "s4"]
    assert types(events)[-2:] == ["turn_completed", "job_failed"]
    error = "max_turns (4) reached without a final response"
    assert events[-1]["data"] == {"status": "failed", "result": None, "error": error, "turns": 4,
                                  "usage": view(api, job_id)["usage"]}
    assert view(api, job_id)["error"] == error
    assert len(llm.requests(model)) == 4
    assert llm.remaining(model) == 1  # the fifth turn was never asked for


def test_invalid_json_in_an_action_is_fed_back(api: Any, llm: FakeLLM) -> None:
    model = unique("badjson")
    bad = '<action type="tool" mode="sync" id="bad">{"name": "echo", "parameters": {"message": hi}}</action>'
    llm.script(model, [
        turn("<thought>Echo it.</thought>" + bad),
        turn(act("good", "echo", {"message": "hi"})),
        turn(final("Echoed $good.")),
    ])

    job_id, events = run_agent(api, "tester", "Echo hi.", model=model)

    error = one(events, "protocol_error")["data"]
    assert error["kind"] == "invalid_json"
    assert error["line"] == 1 and error["column"] == len('<thought>Echo it.</thought>') + len(
        '<action type="tool" mode="sync" id="bad">{"name": "echo", "parameters": {"message": ') + 1
    assert of(events, "action_parsed")[0]["data"]["action"]["id"] == "good"
    assert len(of(events, "action_parsed")) == 1  # the broken action never ran
    feedback = messages(llm, model, 1)[-1]["content"]
    assert feedback.startswith("<feedback>\nYour last output had 1 protocol error.")
    assert f"- line 1, column {error['column']}: invalid_json" in feedback
    assert error["message"] in feedback
    assert feedback.endswith("</feedback>\n\n" + PROTOCOL_REMINDER)  # it did nothing else either
    assert messages(llm, model, 2)[-1]["content"] == '<result id="good" status="ok">hi</result>'
    assert events[-1]["type"] == "job_completed"
    assert view(api, job_id)["result"] == "Echoed hi."


def test_turns_without_action_or_final_response_get_a_reminder(api: Any, llm: FakeLLM) -> None:
    model = unique("remind")
    llm.script(model, [
        turn("<thought>Let me think about it.</thought>"),
        turn('Some loose text. <response final="false">Still thinking.</response>'),
        turn(final("Done thinking.")),
    ])

    job_id, events = run_agent(api, "tester", "Think.", model=model)

    assert types(events) == [
        "job_queued", "job_started",
        "turn_started", "thought_chunk", "thought_end", "usage", "turn_completed",
        "turn_started", "text", "response_chunk", "usage", "response_end", "turn_completed",
        "turn_started", "response_chunk", "usage", "response_end", "turn_completed",
        "job_completed"]
    assert messages(llm, model, 1)[-1] == {"role": "user", "content": PROTOCOL_REMINDER}
    assert messages(llm, model, 2) == [
        {"role": "user", "content": "Think."},
        {"role": "assistant", "content": "<thought>Let me think about it.</thought>"},
        {"role": "user", "content": PROTOCOL_REMINDER},
        {"role": "assistant", "content": 'Some loose text. <response final="false">Still '
                                         'thinking.</response>'},
        {"role": "user", "content": PROTOCOL_REMINDER},
    ]
    assert text_of(events, "text") == "Some loose text. "
    assert view(api, job_id)["result"] == "Done thinking."


def test_three_idle_turns_in_a_row_fail_the_job(api: Any, llm: FakeLLM) -> None:
    model = unique("idle")
    llm.script(model, [turn(f"<thought>Hmm {i}.</thought>") for i in range(1, 5)])

    job_id, events = run_agent(api, "tester", "Do something.", model=model)

    assert [e["data"]["turn"] for e in of(events, "turn_completed")] == [1, 2, 3]
    error = "3 turns in a row without an action or a final response"
    assert events[-1]["type"] == "job_failed"
    assert events[-1]["data"] == {"status": "failed", "result": None, "error": error, "turns": 3,
                                  "usage": view(api, job_id)["usage"]}
    assert view(api, job_id)["status"] == "failed"
    assert [m[-1]["content"] for m in (messages(llm, model, i) for i in range(3))] == [
        "Do something.", PROTOCOL_REMINDER, PROTOCOL_REMINDER]
    assert llm.remaining(model) == 1


def test_a_tool_outside_the_manifest_is_refused_and_fed_back(api: Any, llm: FakeLLM) -> None:
    model = unique("refused")
    llm.script(model, [
        turn(act("w", "write_file", {"path": "x.txt", "content": "hi"}, mode="async")
             + act("t", "teleport", {"to": "mars"}, mode="async")
             + act("ok", "echo", {"message": "still here"})),
        turn(final("I may not write files or teleport.")),
    ])

    job_id, events = run_agent(api, "tester", "Write a file, then teleport.", model=model)

    for ident, tool in (("w", "write_file"), ("t", "teleport")):
        message = (f"tool {tool!r} is not available to agent 'tester' (it may use: "
                   f"{TESTER_TOOLS})")
        assert one(events, "action_failed", ident)["data"]["error"] == message
        assert not of(events, "action_started", ident)  # never sent to a pool
        assert not of(events, "action_queued", ident)  # nor queued
    assert one(events, "action_completed", "ok")["data"]["result"] == "still here"
    feedback = sorted(messages(llm, model, 1)[-1]["content"].split("\n"))
    assert feedback == sorted([
        f'<result id="w" status="error">tool \'write_file\' is not available to agent '
        f"'tester' (it may use: {TESTER_TOOLS})</result>",
        f'<result id="t" status="error">tool \'teleport\' is not available to agent '
        f"'tester' (it may use: {TESTER_TOOLS})</result>",
        '<result id="ok" status="ok">still here</result>'])
    job = view(api, job_id)
    assert job["status"] == "completed"
    assert {a["id"]: a["status"] for a in job["actions"]} == {"w": "error", "t": "error", "ok": "ok"}


# ------------------------------------------------------------------------------ native tool calls


def test_native_tool_calls_become_actions(api: Any, llm: FakeLLM) -> None:
    model = unique("native")
    llm.script(model, [
        turn("<thought>Both at once.</thought>", tool_calls=[
            {"id": "call_echo", "name": "echo", "arguments": {"message": "ping"}},
            {"id": "call_calc", "name": "calculator", "arguments": {"expression": "6*7"}}]),
        turn(final("echo: $call_echo, 6*7 = $call_calc.")),
    ])

    job_id, events = run_agent(api, "native", "Ping and multiply.", model=model)

    parsed = [e["data"]["action"] for e in of(events, "action_parsed")]
    assert [(a["id"], a["type"], a["mode"], a["name"], a["parameters"]) for a in parsed] == [
        ("call_echo", "tool", "async", "echo", {"message": "ping"}),
        ("call_calc", "tool", "async", "calculator", {"expression": "6*7"})]
    for ident in ("call_echo", "call_calc"):
        assert one(events, "action_queued", ident)["seq"] < one(events, "action_started", ident)["seq"]
        assert one(events, "action_started", ident)["seq"] < one(events, "action_completed", ident)["seq"]
    # both are independent: no barrier, no dependency
    assert {a["id"]: (a["depends_on"], a["after"]) for a in view(api, job_id)["actions"]} == {
        "call_echo": ([], []), "call_calc": ([], [])}
    first = llm.requests(model)[0]
    assert [t["function"]["name"] for t in first["tools"]] == ["echo", "calculator"]
    assert all(t["type"] == "function" and t["function"]["parameters"]["type"] == "object"
               for t in first["tools"])
    # the conversation as the model was trained on it: its calls in `tool_calls`, then one
    # `tool` message per call, in call order (not completion order), and no user message
    history = messages(llm, model, 1)
    assert history[1] == {"role": "assistant", "content": "<thought>Both at once.</thought>",
                          "tool_calls": [
        {"id": "call_echo", "type": "function",
         "function": {"name": "echo", "arguments": '{"message": "ping"}'}},
        {"id": "call_calc", "type": "function",
         "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'}}]}
    assert history[2:] == [{"role": "tool", "tool_call_id": "call_echo", "content": "ping"},
                           {"role": "tool", "tool_call_id": "call_calc", "content": "42"}]
    assert view(api, job_id)["result"] == "echo: ping, 6*7 = 42."


def test_a_native_tools_model_that_answers_in_plain_text_ends_the_job(api: Any, llm: FakeLLM) -> None:
    """How tool-calling models finish: no tags, no calls, just the answer."""
    model = unique("plain")
    llm.script(model, [
        turn(tool_calls=[{"id": "call_x", "name": "calculator", "arguments": {"expression": "2+2"}}]),
        turn("The answer is 4."),
    ])

    job_id, events = run_agent(api, "native", "Add.", model=model)

    job = view(api, job_id)
    assert (job["status"], job["result"]) == ("completed", "The answer is 4.")
    assert of(events, "response_end")[-1]["data"] == {"final": True, "text": "The answer is 4."}
    assert len(llm.requests(model)) == 2  # no reminder turn
    assert messages(llm, model, 1)[-1] == {"role": "tool", "tool_call_id": "call_x", "content": "4"}


def test_native_calls_and_protocol_actions_mix_in_one_turn(api: Any, llm: FakeLLM) -> None:
    model = unique("mixed")
    llm.script(model, [
        turn("<thought>One of each.</thought>" + act("t", "echo", {"message": "text"}, mode="async"),
             tool_calls=[{"id": "call_n", "name": "echo", "arguments": {"message": "native"}}]),
        turn(final("$t and $call_n")),
    ])

    job_id, events = run_agent(api, "native", "Mix.", model=model)

    assert view(api, job_id)["result"] == "text and native"
    assert {e["data"]["action_id"] for e in of(events, "action_completed")} == {"t", "call_n"}
    history = messages(llm, model, 1)
    assert history[1]["role"] == "assistant"
    assert history[1]["content"].startswith("<thought>One of each.</thought><action")
    assert [c["id"] for c in history[1]["tool_calls"]] == ["call_n"]
    assert history[2] == {"role": "tool", "tool_call_id": "call_n", "content": "native"}
    assert history[3] == {"role": "user", "content": '<result id="t" status="ok">text</result>'}


def test_parallel_tool_calls_run_in_parallel(api: Any, llm: FakeLLM) -> None:
    """Three tool calls of one message, each sleeping 0.6 s, all run at once. (`native` may only
    use instant tools, so this uses `tester`, whose model may also answer with tool calls: the
    runtime turns them into actions whether or not it offered `tools`.)"""
    model = unique("parallel")
    calls = [{"id": f"call_{i}", "name": "sleep", "arguments": {"seconds": 0.6}} for i in range(3)]
    llm.script(model, [turn(tool_calls=calls), turn(final("Slept three times."))])

    job_id, events = run_agent(api, "tester", "Sleep thrice.", model=model)

    ids = ["call_0", "call_1", "call_2"]
    last_start = max(seq(events, "action_started", i) for i in ids)
    first_end = min(seq(events, "action_completed", i) for i in ids)
    assert last_start < first_end  # all three were running together
    actions = view(api, job_id)["actions"]
    span = max(a["finished_at"] for a in actions) - min(a["started_at"] for a in actions)
    assert span < 1.5, span  # one after the other would take 1.8 s
    assert "tools" not in llm.requests(model)[0]  # tester is not a native-tools agent
    assert view(api, job_id)["result"] == "Slept three times."


# ------------------------------------------------------------------------------ llm and agent actions


def test_an_llm_action_runs_a_completion_on_the_llm_pool(
        api: Any, llm: FakeLLM, workers: dict[str, harness.Process]) -> None:
    model = unique("llmact")
    llm.script(model, [
        turn("<thought>Summarise first.</thought>"
             + act("sum", "summarize", {"prompt": "Summarise: cats sleep a lot."}, kind="llm")),
        turn('{"summary": "Cats nap."}'),  # the llm action's completion
        turn(final("Summary: $sum.summary")),
    ])

    job_id, events = run_agent(api, "tester", "Summarise the cat facts.", model=model)

    assert workers["llm"].owns_pid(worker_pid(one(events, "action_started", "sum")))
    assert one(events, "action_completed", "sum")["data"]["result"] == {"summary": "Cats nap."}
    task = llm.requests(model)[1]
    assert task["messages"] == [
        {"role": "system", "content": "You perform one task: summarize. Answer with its result "
                                      "only, without preamble."},
        {"role": "user", "content": "Summarise: cats sleep a lot."}]
    assert "tools" not in task
    assert messages(llm, model, 2)[-1]["content"] == \
        '<result id="sum" status="ok">{"summary": "Cats nap."}</result>'
    assert view(api, job_id)["result"] == "Summary: Cats nap."


def test_an_agent_action_runs_a_child_job(api: Any, llm: FakeLLM,
                                          workers: dict[str, harness.Process]) -> None:
    model = unique("parent")
    llm.script(model, [
        turn("<thought>Ask the helper.</thought>"
             + act("ask", "helper", {"input": "What is 2+3?"}, kind="agent")),
        turn(final("The helper says: $ask")),
    ])
    llm.script("helper", [
        turn(act("c", "calculator", {"expression": "2+3"})),
        turn(final("2+3 = $c")),
    ])

    job_id, events = run_agent(api, "tester", "Delegate a sum.", model=model)

    child_id = one(events, "child_job")["data"]["job_id"]
    assert one(events, "child_job")["data"] == {"action_id": "ask", "job_id": child_id}
    started = one(events, "action_started", "ask")
    assert workers["agent"].owns_pid(worker_pid(started))
    assert started["seq"] < seq(events, "child_job") < seq(events, "action_completed", "ask")
    assert one(events, "action_completed", "ask")["data"]["result"] == "2+3 = 5"
    assert messages(llm, model, 1)[-1]["content"] == '<result id="ask" status="ok">2+3 = 5</result>'
    assert view(api, job_id)["result"] == "The helper says: 2+3 = 5"

    child = view(api, child_id)
    assert (child["status"], child["result"]) == ("completed", "2+3 = 5")
    child_events = finish(api, child_id)
    assert child_events[0]["type"] == "job_queued"
    assert child_events[0]["data"] == {"kind": "agent", "agent": "helper", "parent_job": job_id,
                                       "parent_action": "ask", "depth": 1}
    assert child_events[-1]["data"]["result"] == "2+3 = 5"
    helper_requests = llm.requests("helper")[-2:]
    assert "# You\n\nYou are helper," in helper_requests[0]["messages"][0]["content"]
    assert helper_requests[0]["messages"][1:] == [{"role": "user", "content": "What is 2+3?"}]


def test_a_failed_child_job_fails_the_agent_action(api: Any, llm: FakeLLM) -> None:
    model = unique("orphan")
    llm.script(model, [
        turn(act("ask", "helper", {"input": "Help."}, kind="agent")),
        turn(final("The helper could not help.")),
    ])
    llm.script("helper", [Turn(fail_status=400, error_message="helper model is down")])

    job_id, events = run_agent(api, "tester", "Delegate.", model=model)

    child_id = one(events, "child_job")["data"]["job_id"]
    child_error = (f"model error: model endpoint {llm.url}/chat/completions answered HTTP 400: "
                   "helper model is down")
    assert view(api, child_id)["error"] == child_error
    error = f"agent job {child_id} failed: {child_error}"
    assert one(events, "action_failed", "ask")["data"]["error"] == error
    assert messages(llm, model, 1)[-1]["content"] == f'<result id="ask" status="error">{error}</result>'
    assert view(api, job_id)["result"] == "The helper could not help."


def test_nested_agents_do_not_deadlock_a_full_agent_pool(api: Any, llm: FakeLLM) -> None:
    """Four parents at once on the agent pool (two threads), each calling a sync helper: their
    turns, the agent actions and the four child jobs' turns all queue on that one pool. No turn
    holds a slot while its actions run, so all of them finish."""
    models = [unique(f"nest{i}") for i in range(4)]
    thinking = "<thought>" + "Delegating this to the helper agent. " * 6 + "</thought>"
    for model in models:
        llm.script(model, [
            # ~0.3 s of streaming each: two at a time fill the pool while the rest queue
            Turn(text=thinking + act("ask", "helper", {"input": "Say done."}, kind="agent"),
                 tokens_per_second=200),
            turn(final("Parent got: $ask")),
        ])
    llm.script("helper", [turn(final("done")) for _ in models])

    jobs = [start(api, "tester", "Delegate.", model=model) for model in models]
    for job_id in jobs:
        events = finish(api, job_id, timeout=120)
        assert events[-1]["type"] == "job_completed", events[-1]
        assert events[-1]["data"]["result"] == "Parent got: done"
        child_id = one(events, "child_job")["data"]["job_id"]
        child = view(api, child_id)
        assert (child["status"], child["result"]) == ("completed", "done")
        assert one(events, "action_completed", "ask")["data"]["result"] == "done"

    # the pool held two turns at once, never more (how many did overlap is the scheduler's)
    spans = [(llm.requests(m)[0]["received_at"], llm.stream_log(m)[0][-1][0]) for m in models]
    overlap = max(sum(1 for b, e in spans if b <= t < e) for t, _ in spans)
    assert 1 <= overlap <= 2, spans


# ------------------------------------------------------------------------------ sessions


def test_a_session_carries_the_conversation(api: Any, llm: FakeLLM) -> None:
    model = unique("session")
    llm.script(model, [
        turn(final("It is 5.")),
        turn(final("It is 10."), delay_s=1.0),  # slow: a message sent meanwhile gets 409
    ])
    created = httpx.post(f"{api.url}/v1/sessions", json={"agent": "tester",
                                                         "options": {"model": model}})
    assert created.status_code == 201, created.text
    session = created.json()["id"]

    def send(content: str) -> httpx.Response:
        return httpx.post(f"{api.url}/v1/sessions/{session}/messages", json={"content": content})

    first = send("What is 2+3?")
    assert first.status_code == 202, first.text
    assert finish(api, first.json()["id"])[-1]["type"] == "job_completed"
    second = send("And doubled?")
    assert second.status_code == 202, second.text
    busy = send("Hello?")
    assert busy.status_code == 409, busy.text
    assert second.json()["id"] in busy.text
    assert finish(api, second.json()["id"])[-1]["data"]["result"] == "It is 10."

    assert messages(llm, model, 1) == [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "It is 5."},
        {"role": "user", "content": "And doubled?"}]
    data = httpx.get(f"{api.url}/v1/sessions/{session}").json()
    jobs = [first.json()["id"], second.json()["id"]]
    assert data["agent"] == "tester"
    assert data["jobs"] == jobs
    assert data["messages"] == [
        {"role": "user", "content": "What is 2+3?", "job_id": jobs[0]},
        {"role": "assistant", "content": "It is 5.", "job_id": jobs[0]},
        {"role": "user", "content": "And doubled?", "job_id": jobs[1]},
        {"role": "assistant", "content": "It is 10.", "job_id": jobs[1]}]
    assert httpx.get(f"{api.url}/v1/sessions/nope").status_code == 404
    assert httpx.post(f"{api.url}/v1/sessions", json={"agent": "nobody"}).status_code == 422


def test_messages_sent_to_a_session_at_once_start_one_job(api: Any, llm: FakeLLM) -> None:
    """Six clients post to one idle session at the same moment: one message starts a job, the
    others get 409, and the session records one message (each request used to pass the
    "last job ended" check before any had appended its job, so all six started one)."""
    model = unique("session-race")
    llm.script(model, [turn(final("Hi."), delay_s=0.5)])
    created = httpx.post(f"{api.url}/v1/sessions", json={"agent": "tester",
                                                         "options": {"model": model}})
    session = created.json()["id"]
    gate = threading.Barrier(6)

    def send(n: int) -> httpx.Response:
        gate.wait()
        return httpx.post(f"{api.url}/v1/sessions/{session}/messages",
                          json={"content": f"message {n}"})

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(send, range(6)))
    accepted = [a for a in answers if a.status_code == 202]
    assert sorted(a.status_code for a in answers) == [202] + [409] * 5, [a.text for a in answers]
    job_id = accepted[0].json()["id"]
    assert all(job_id in a.json()["detail"]["message"] for a in answers if a.status_code == 409)
    assert finish(api, job_id)[-1]["data"]["result"] == "Hi."
    data = httpx.get(f"{api.url}/v1/sessions/{session}").json()
    assert data["jobs"] == [job_id]
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert len(llm.requests(model)) == 1


# ------------------------------------------------------------------------------ model failures


def test_a_stream_broken_midway_restarts_the_turn(api: Any, llm: FakeLLM) -> None:
    model = unique("drop")
    text = "<thought>Checking the numbers carefully.</thought>" + act("c", "calculator",
                                                                       {"expression": "1+1"})
    llm.script(model, [
        turn(text, fail_after_chars=24),  # drops the connection inside the thought
        turn(text),
        turn(final("It is $c.")),
    ])

    job_id, events = run_agent(api, "tester", "Add.", model=model)

    running = {"action_started", "action_completed"}  # the sync action runs as the turn closes
    assert types([e for e in events if e["type"] not in running]) == [
        "job_queued", "job_started", "turn_started", "thought_chunk", "warning", "thought_chunk",
        "thought_end", "action_parsed", "action_queued", "usage",
        "turn_completed", "turn_started", "response_chunk", "usage", "response_end",
        "turn_completed", "job_completed"]
    warning = one(events, "warning")
    assert warning["data"]["kind"] == "model_retry"
    assert warning["data"]["message"].endswith("; turn restarted")
    before = [e for e in events if e["seq"] < warning["seq"]]
    assert text_of(before, "thought_chunk") == text[len("<thought>"):24]  # the broken attempt
    assert one(events, "thought_end")["data"]["text"] == "Checking the numbers carefully."
    # the retried turn ends at its sync action's close tag: the coordinator may close the
    # stream before the server has written its last frame
    dropped, retried, last = llm.outcomes(model)
    assert (dropped, last) == ("dropped", "complete")
    assert retried in {"complete", "client_disconnected"}
    requests = llm.requests(model)
    assert requests[0]["messages"] == requests[1]["messages"]  # the same turn, asked again
    # the conversation holds the restarted turn once, not the broken attempt
    assert messages(llm, model, 2)[1] == {"role": "assistant", "content": text}
    assert view(api, job_id)["result"] == "It is 2."


def test_a_non_retryable_model_error_fails_the_job(api: Any, llm: FakeLLM) -> None:
    model = unique("http400")
    llm.script(model, [Turn(fail_status=400, error_message="context length exceeded")])

    job_id, events = run_agent(api, "tester", "Hi.", model=model)

    assert types(events) == ["job_queued", "job_started", "turn_started", "job_failed"]
    error = (f"model error: model endpoint {llm.url}/chat/completions answered HTTP 400: "
             "context length exceeded")
    assert events[-1]["data"] == {"status": "failed", "result": None, "error": error, "turns": 1}
    assert view(api, job_id)["error"] == error
    assert llm.outcomes(model) == ["failed"]  # not retried


def test_a_server_error_before_the_stream_is_retried_transparently(api: Any, llm: FakeLLM) -> None:
    model = unique("http500")
    llm.script(model, [Turn(fail_status=500), turn(final("Recovered."))])

    job_id, events = run_agent(api, "tester", "Hi.", model=model)

    assert types(events) == ["job_queued", "job_started", "turn_started", "response_chunk",
                             "usage", "response_end", "turn_completed", "job_completed"]
    assert llm.outcomes(model) == ["failed", "complete"]
    requests = llm.requests(model)
    assert requests[0]["messages"] == requests[1]["messages"]
    assert view(api, job_id)["result"] == "Recovered."


# ------------------------------------------------------------------------------ API


def test_agents_are_listed_and_unknown_ones_rejected(api: Any) -> None:
    listed = httpx.get(f"{api.url}/v1/agents").json()["items"]
    assert [a["name"] for a in listed] == TEST_AGENTS
    tester = next(a for a in listed if a["name"] == "tester")
    assert tester["model"] == {"provider": "openai", "model": "tester",
                               "base_url": "${CORTEX_TEST_LLM_URL}", "native_tools": False,
                               "transcript": None, "limits": None, "name": None}
    assert (tester["agents"], tester["max_turns"]) == (["helper"], 4)
    before = [j["id"] for j in httpx.get(f"{api.url}/v1/jobs?limit=5").json()["items"]]
    response = httpx.post(f"{api.url}/v1/jobs", json={"agent": "nobody", "input": "hi"})
    assert response.status_code == 422
    assert "nobody" in response.text
    after = [j["id"] for j in httpx.get(f"{api.url}/v1/jobs?limit=5").json()["items"]]
    assert after == before


def test_one_nesting_rule_refuses_a_child_past_the_agents_max_depth(api: Any, llm: FakeLLM) -> None:
    """`shallow` (max_depth 0) lists `helper`, but a child would be at depth 1: the action
    fails with the rule's message (`jobs.submit_child`) and no child job is created."""
    model = unique("shallow")
    llm.script(model, [
        turn(act("down", "helper", {"input": "Help."}, kind="agent")),
        turn(final("Alone, then.")),
    ])

    job_id, events = run_agent(api, "shallow", "Nest.", model=model)

    error = one(events, "action_failed", "down")["data"]["error"]
    assert error == "agent 'helper': nesting depth limit (0) reached"
    assert of(events, "child_job") == []
    assert messages(llm, model, 1)[-1]["content"] == \
        f'<result id="down" status="error">{error}</result>'
    assert view(api, job_id)["result"] == "Alone, then."


def test_an_action_that_depends_on_itself_fails_in_a_stream_as_in_a_document(
        api: Any, llm: FakeLLM) -> None:
    model = unique("selfdep")
    llm.script(model, [
        turn('<action type="tool" mode="sync" id="loop" depends_on="loop">'
             '{"name": "echo", "parameters": {"message": "never"}}</action>'),
        turn(final("Noted.")),
    ])

    job_id, events = run_agent(api, "tester", "Loop.", model=model)

    assert one(events, "action_failed", "loop")["data"]["error"] == "dependency cycle: loop -> loop"
    assert of(events, "action_started") == []
    assert view(api, job_id)["status"] == "completed"


def test_the_turn_that_waited_for_its_actions_takes_the_next_one(api: Any, llm: FakeLLM) -> None:
    """A turn whose actions still run waits for them in its worker thread (`turn_wait_s`): the
    last one's end is published to that process, and the next turn starts there, with no task
    through the queue. Both of this job's next turns start so, and its last turn's end, with
    nothing to wait for, is its own."""
    before = quiet_scrape(api)
    model = unique("in-place")
    llm.script(model, [
        turn("<thought>Sleep first.</thought>" + act("s", "sleep", {"seconds": 0.4}, mode="async")),
        turn(act("e", "echo", {"message": "woke"}, mode="async")),
        turn(final("Slept $s.slept s, then $e.")),
    ])
    job_id, events = run_agent(api, "tester", "Sleep, then echo.", model=model)
    after, _ = scrape(api)

    job = view(api, job_id)
    assert (job["status"], job["result"]) == ("completed", "Slept 0.4 s, then woke."), types(events)
    assert [e["data"]["turn"] for e in of(events, "turn_started")] == [1, 2, 3]
    taken = {"taken": "in_place"}, {"taken": "queued"}
    assert [value(after, "cortex_agent_drains_total", **labels)
            - value(before, "cortex_agent_drains_total", **labels) for labels in taken] == [3, 0]
