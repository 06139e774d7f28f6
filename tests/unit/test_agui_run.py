"""`cortex_api.agui.AgUiRun` on synthetic job logs: the runs of `POST /v1/agents/{name}/ag-ui`
under the client's ids, joined after any seq, and paused for an approval (an interrupt) and
resumed by the next run of the same job."""

from __future__ import annotations

import time
from typing import Any

import pytest
from ag_ui.core import RunFinishedEvent

from cortex_api.agui import AgUiRun
from cortex_api.routes.agui import Run, RunRefused, _attach, thread_session
from tests.agui_checks import assert_well_formed, parse_all
from tests.unit.test_agui import AGENT, JOB, log, parsed

pytestmark = pytest.mark.unit

#: An agent job whose deploy waits for a person (the wait begins at `PAUSE`), is approved,
#: and answers in a second turn.
APPROVAL = log(
    ("job_queued", {"kind": "agent", "agent": "tester"}),
    ("job_started", {"kind": "agent", "agent": "tester"}),
    ("turn_started", {"turn": 1}),
    ("thought_chunk", {"text": "Deploying."}),
    ("thought_end", {"text": "Deploying."}),
    parsed("d", "deploy", {"target": "web-1"}, mode="sync"),
    ("approval_requested", {"action_id": "d", "type": "tool", "name": "deploy",
                            "parameters": {"target": "web-1"}, "timeout_s": 60,
                            "expires_at": 1700000100.0}),
    ("usage", {"turn": 1, "prompt_tokens": 100, "completion_tokens": 20}),
    ("action_approved", {"action_id": "d", "by": "ag-ui", "reason": None}),
    ("action_queued", {"action_id": "d"}),
    ("action_started", {"action_id": "d", "attempt": 1, "worker": "vm:1"}),
    ("action_completed", {"action_id": "d", "status": "ok", "duration_ms": 2.0,
                          "result": {"deployed": "web-1"}}),
    ("turn_completed", {"turn": 1}),
    ("turn_started", {"turn": 2}),
    ("response_chunk", {"text": "Done.", "final": True}),
    ("usage", {"turn": 2, "prompt_tokens": 150, "completion_tokens": 5}),
    ("response_end", {"final": True, "text": "Done."}),
    ("job_completed", {"status": "completed", "result": "Done.", "error": None, "turns": 2}),
)
PAUSE = 8  # the usage event: the turn has generated, only the approval is left


def stream(run: AgUiRun, events: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    return [pair for event in events for pair in run(event)]


def items(pairs: list[tuple[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    return [item for _, item in pairs]


def without_earlier_results(events: list[dict[str, Any]],
                            earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A run may answer calls made before it began (after an interrupt, or a join)."""
    called = {e["toolCallId"] for e in earlier if e["type"] == "TOOL_CALL_END"}
    return [e for e in events if e["type"] != "TOOL_CALL_RESULT" or e["toolCallId"] not in called]


def test_a_run_is_its_job_under_the_clients_thread_and_run_ids() -> None:
    pairs = stream(AgUiRun(JOB, "t1", "r1", session_id="s1"), AGENT)
    events = items(pairs)
    parse_all(events)
    assert_well_formed(events)
    assert (events[0]["type"], events[0]["threadId"], events[0]["runId"]) == ("RUN_STARTED",
                                                                             "t1", "r1")
    assert events[1] == {"type": "CUSTOM", "name": "cortex.run",
                         "value": {"jobId": JOB, "sessionId": "s1"}}
    assert events[-1]["type"] == "RUN_FINISHED" and events[-1]["runId"] == "r1"
    ids = [seq for seq, _ in pairs]
    assert ids == sorted(ids) and ids[0] == 1 and ids[-1] == len(AGENT)


@pytest.mark.parametrize("join", range(1, len(AGENT) - 1))
def test_a_run_joined_after_any_seq_starts_as_a_run_and_goes_on_unbroken(join: int) -> None:
    unbroken = stream(AgUiRun(JOB, "t1", "r1", session_id="s1"), AGENT)
    run = AgUiRun(JOB, "t1", "r1", session_id="s1")
    for event in AGENT[:join]:
        run.seen(event)
    pairs = stream(run, AGENT[join:])
    events = items(pairs)
    parse_all(events)
    assert_well_formed(without_earlier_results(events, items(unbroken)))
    assert events[0]["type"] == "RUN_STARTED" and events[1]["name"] == "cortex.run"
    head = [pair for pair in pairs if pair[0] == join]
    assert all(item["type"] in ("RUN_STARTED", "CUSTOM", "STEP_STARTED", "REASONING_START",
                                "REASONING_MESSAGE_START", "TEXT_MESSAGE_START")
               for _, item in head)
    assert pairs[len(head):] == [pair for pair in unbroken if pair[0] > join]


def test_a_job_waiting_for_a_person_ends_its_run_with_an_interrupt() -> None:
    run = AgUiRun(JOB, "t1", "r1", session_id="s1", until=PAUSE)
    pairs = stream(run, APPROVAL)
    events = items(pairs)
    assert run.ended and pairs[-1][0] == PAUSE
    parse_all(events)
    assert_well_formed(events)
    finished = RunFinishedEvent.model_validate(events[-1])
    assert finished.outcome is not None and finished.outcome.type == "interrupt"
    assert events[-1]["outcome"]["interrupts"] == [{
        "id": f"{JOB}:d:approval", "reason": "tool_call", "toolCallId": f"{JOB}:d",
        "message": 'Approve tool \'deploy\' with {"target": "web-1"}?',
        "responseSchema": run.interrupts()[0]["responseSchema"],
        "expiresAt": "2023-11-14T22:15:00Z",
        "metadata": {"cortex": {"jobId": JOB, "actionId": "d", "type": "tool",
                                "name": "deploy", "parameters": {"target": "web-1"}}}}]
    assert events[-1]["usage"] == [{"inputTokens": 100, "outputTokens": 20, "totalTokens": 120}]


def test_a_pause_found_later_ends_the_run_at_once_or_where_it_began() -> None:
    now = AgUiRun(JOB, "t1", "r1", session_id="s1")
    stream(now, APPROVAL[:PAUSE])
    assert now.awaiting and not now.ended
    assert [item["type"] for _, item in now.pause(PAUSE)][-1] == "RUN_FINISHED"
    assert now.ended and now(APPROVAL[PAUSE]) == []
    ahead = AgUiRun(JOB, "t1", "r1", session_id="s1")
    stream(ahead, APPROVAL[:PAUSE - 1])
    assert ahead.pause(PAUSE) == [] and not ahead.ended
    assert items(ahead(APPROVAL[PAUSE - 1]))[-1]["outcome"]["type"] == "interrupt"


def test_the_next_run_goes_on_from_the_interrupt_with_its_own_usage() -> None:
    first = items(stream(AgUiRun(JOB, "t1", "r1", session_id="s1", until=PAUSE), APPROVAL))
    run = AgUiRun(JOB, "t1", "r2", session_id="s1", start=PAUSE)
    for event in APPROVAL[:PAUSE]:
        run.seen(event)
    pairs = stream(run, APPROVAL[PAUSE:])
    events = items(pairs)
    parse_all(events)
    assert_well_formed(without_earlier_results(events, first))
    assert pairs[0] == (PAUSE, {"type": "RUN_STARTED", "threadId": "t1", "runId": "r2"})
    assert [e["type"] for e in events[1:3]] == ["CUSTOM", "STEP_STARTED"]
    assert [e["toolCallId"] for e in events if e["type"] == "TOOL_CALL_RESULT"] == [f"{JOB}:d"]
    assert events[-1]["type"] == "RUN_FINISHED" and events[-1]["result"] == "Done."
    assert events[-1]["usage"] == [{"inputTokens": 150, "outputTokens": 5, "totalTokens": 155}]


def test_a_thread_is_a_session_of_one_tenant_and_agent() -> None:
    sessions = {thread_session(t, a, "thread-1") for t in ("acme", "globex")
                for a in ("tester", "helper")}
    assert len(sessions) == 4
    assert thread_session("acme", "tester", "thread-1") == thread_session("acme", "tester",
                                                                          "thread-1")


class Runs:
    """The AG-UI part of a Store, in memory."""

    def __init__(self, records: dict[str, dict[str, Any]]) -> None:
        self.records = records

    def agui_runs(self, session_id: str) -> dict[str, dict[str, Any]]:
        return dict(self.records)

    def drop_agui_run(self, session_id: str, run_id: str) -> None:
        self.records.pop(run_id, None)


def test_a_run_whose_start_never_finished_is_dropped_and_can_be_posted_again() -> None:
    stale = Runs({"r1": {"job": None, "after": 0, "until": None, "at": time.time() - 3600}})
    with pytest.raises(RunRefused) as refused:
        _attach(stale, "s1", "r1")  # type: ignore[arg-type]
    assert refused.value.code == "run_not_started" and stale.records == {}
    started = Runs({"r1": {"job": "j1", "after": 5, "until": 9, "at": time.time()}})
    assert _attach(started, "s1", "r1") == Run("s1", "r1", "j1", 5, 9)  # type: ignore[arg-type]


#: An agent job that calls a frontend tool (a client tool: held for the client, no interrupt);
#: the client answers in the next run and the job answers with its result.
CLIENT = log(
    ("job_queued", {"kind": "agent", "agent": "tester"}),
    ("job_started", {"kind": "agent", "agent": "tester"}),
    ("turn_started", {"turn": 1}),
    parsed("c", "pick_color", {"hint": "warm"}, mode="sync"),
    ("approval_requested", {"action_id": "c", "type": "tool", "name": "pick_color",
                            "parameters": {"hint": "warm"}, "timeout_s": 60,
                            "expires_at": 1700000100.0, "client": True}),
    ("usage", {"turn": 1, "prompt_tokens": 100, "completion_tokens": 20}),
    ("action_completed", {"action_id": "c", "status": "ok", "duration_ms": 2.0,
                          "result": "crimson"}),
    ("turn_completed", {"turn": 1}),
    ("turn_started", {"turn": 2}),
    ("response_end", {"final": True, "text": "You picked crimson."}),
    ("job_completed", {"status": "completed", "result": "You picked crimson.", "error": None,
                       "turns": 2}),
)
CLIENT_PAUSE = 6


def test_a_frontend_tool_call_ends_the_run_with_its_call_and_no_interrupt() -> None:
    run = AgUiRun(JOB, "t1", "r1", session_id="s1", until=CLIENT_PAUSE)
    events = items(stream(run, CLIENT))
    parse_all(events)
    assert_well_formed(events)
    assert [e["type"] for e in events if e["type"].startswith("TOOL_CALL")] == [
        "TOOL_CALL_START", "TOOL_CALL_ARGS", "TOOL_CALL_END"]
    assert events[-1]["type"] == "RUN_FINISHED" and "outcome" not in events[-1]
    assert run.interrupts() == [] and run.client_calls() == {f"{JOB}:c": "c"}


def test_the_run_that_answers_a_frontend_tool_gets_no_result_event_for_it() -> None:
    run = AgUiRun(JOB, "t1", "r2", session_id="s1", start=CLIENT_PAUSE)
    for event in CLIENT[:CLIENT_PAUSE]:
        run.seen(event)
    events = items(stream(run, CLIENT[CLIENT_PAUSE:]))
    parse_all(events)
    assert [e for e in events if e["type"] == "TOOL_CALL_RESULT"] == []  # the client has it
    assert run.client_calls() == {}
    assert events[-1]["type"] == "RUN_FINISHED" and events[-1]["result"] == "You picked crimson."
