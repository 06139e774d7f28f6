"""Agent jobs stop promptly when cancelled, or when their wall time runs out, mid-generation,
with real workers streaming from the fake model while the API cancels (these wait on
timers: not in the in-process lane).

How often a failing model is asked (the retry budget) is tested in-process, in
tests/engine/test_agents.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from cortex_api.client import Client, NotFound
from cortex_api.models import JobOptions
from cortex_worker.jobs.lifecycle import child_job_id
from cortex_worker.jobs.turns.reading import STATUS_CHECK_S
from cortex_worker.protocol.events import Event
from tests import harness
from tests.fake_llm import FakeLLM, Turn
from tests.integration.test_agents import (
    act,
    api,  # noqa: F401  (fixture)
    llm,  # noqa: F401  (fixture)
    unique,
)

TERMINAL = {"ok", "error", "timeout", "skipped", "cancelled"}
#: What a cancelled job may not log after `job_cancelled`: nothing new is parsed, registered,
#: queued, started or streamed.
NOTHING_NEW = {"action_parsed", "action_queued", "action_started", "action_retrying",
               "thought_chunk", "response_chunk", "text", "turn_started", "child_job"}


@pytest.fixture
def client(api: Any) -> Iterator[Client]:  # noqa: F811
    with Client(api.url) as cortex:
        yield cortex


def start(client: Client, agent: str, model: str) -> str:
    return client.submit_agent(agent, "go", options=JobOptions(model=model)).id


def finish(client: Client, job_id: str, timeout: float) -> list[Event]:
    """The job's whole event log once it has ended, checked to be numbered without a gap."""
    events = list(client.events(job_id, timeout=timeout))
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    return events


def long_thought(seconds: float, rate: float = 40) -> Turn:
    words = "thinking about it some more " * int(seconds * rate * 4 / 28 + 1)
    return Turn(text=f"<thought>{words}</thought>", tokens_per_second=rate)


def test_cancel_stops_the_generation(client: Client, llm: FakeLLM) -> None:  # noqa: F811
    model = unique("cancel")
    thought = long_thought(120)
    llm.script(model, [thought])
    job_id = start(client, "tester", model)
    streaming_by = time.monotonic() + 10
    while not llm.stream_log(model) and time.monotonic() < streaming_by:
        time.sleep(0.05)
    time.sleep(0.5)
    client.cancel(job_id)
    events = finish(client, job_id, timeout=15)
    assert events[-1].type == "job_cancelled"
    # the coordinator noticed at a status check and hung up on the model: the server saw the
    # client go mid-thought, not the two minutes' text read to the end
    deadline = time.monotonic() + 30
    while llm.outcomes(model)[-1] == "streaming" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert llm.outcomes(model)[-1] == "client_disconnected"
    assert llm.stream_log(model)[-1][-1][1] < len(thought.text)


def test_a_generation_past_the_wall_time_fails_the_job(client: Client,
                                                       llm: FakeLLM) -> None:  # noqa: F811
    model = unique("slow")
    thought = long_thought(120)
    llm.script(model, [thought])
    job_id = start(client, "hasty", model)  # max_wall_time_s: 2
    events = finish(client, job_id, timeout=60)
    assert events[-1].type == "job_failed"
    assert "wall time limit (2 s)" in events[-1].data["error"]
    # the limit ended it, not the two minutes' thought: the generation was hung up on
    harness.wait_until(lambda: llm.outcomes(model)[-1] != "streaming", timeout=30)
    assert llm.outcomes(model) == ["client_disconnected"]
    assert llm.stream_log(model)[-1][-1][1] < len(thought.text)


def thinking_with_actions(count: int, rate: float = 40) -> Turn:
    """A slow thought with an async 5-second `sleep` action every ~0.3 s of text."""
    parts = [("weighing the next step " * 2) + act(f"s{i}", "sleep", {"seconds": 5}, mode="async")
             for i in range(count)]
    return Turn(text="<thought>" + "".join(parts) + "</thought>", tokens_per_second=rate)


def wait_for_actions(client: Client, job_id: str, count: int) -> None:
    harness.wait_until(lambda: len(client.get_job(job_id).actions) >= count, timeout=15,
                       interval=0.02, message=f"job {job_id} never had {count} actions")


def assert_cancelled_completely(client: Client, job_id: str, events: list[Event]) -> None:
    """Nothing new after `job_cancelled`; every action ended, once, in events and record."""
    cancelled = next(e.seq for e in events if e.type == "job_cancelled")
    late = [e for e in events if e.seq > cancelled and e.type in NOTHING_NEW]
    assert late == [], f"logged after job_cancelled: {late}"
    job = client.get_job(job_id)
    assert job.status == "cancelled"
    assert {a.id: a.status for a in job.actions if a.status not in TERMINAL} == {}
    queued = {e.data["action_id"] for e in events if e.type == "action_queued"}
    ended = [e.data["action_id"] for e in events if e.type in
             {"action_completed", "action_failed", "action_skipped", "action_cancelled"}]
    assert sorted(ended) == sorted(set(ended)) and queued <= set(ended)
    assert {a.id for a in job.actions} == set(ended)


def test_cancel_mid_stream_is_immediate_and_complete(client: Client,
                                                     llm: FakeLLM) -> None:  # noqa: F811
    """The server holds its stream just past the second action until the job is cancelled,
    then streams on at 40 tokens a second: the turn hangs up on the model because the end was
    pushed to it, before its own status check (the backstop) could have come round, and long
    before the stream's end (counted from the release, so how long the cancel took to reach
    the job on a busy machine does not count)."""
    model = unique("cancel-acts")
    script = thinking_with_actions(30)
    second = script.text.index("</action>", script.text.index("</action>") + 1) + len("</action>")
    held = (second - 1) // 4  # the token (of 4 characters) that closes the second action
    release = threading.Event()
    script.holds = {held: release}
    llm.script(model, [script])
    job_id = start(client, "tester", model)
    wait_for_actions(client, job_id, 2)
    client.cancel(job_id)
    events = finish(client, job_id, timeout=30)
    assert_cancelled_completely(client, job_id, events)
    assert {a.status for a in client.get_job(job_id).actions} == {"cancelled"}
    release.set()  # the job ended while the model was held
    deadline = time.monotonic() + 30
    while llm.outcomes(model)[-1] == "streaming" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert llm.outcomes(model) == ["client_disconnected"]
    (log,) = llm.stream_log(model)
    # The pushed end stops it at the next chunk; the turn's own status check (every
    # STATUS_CHECK_S, the backstop for a lost push) would have let this many through:
    backstop = int(STATUS_CHECK_S * 40)
    after = len(log) - (held + 1)
    assert after < backstop < len(script.text) // 4 - held, f"{after} chunks after the cancel"


def exists(client: Client, job_id: str) -> bool:
    try:
        client.get_job(job_id)
    except NotFound:
        return False
    return True


def test_cancel_reaches_a_streaming_child_agent(client: Client,
                                                llm: FakeLLM) -> None:  # noqa: F811
    model = unique("cancel-parent")
    child = act("kid", "helper", {"input": "think"}, mode="async", kind="agent")
    llm.script(model, [Turn(text=f"<thought>{child}" + "still going " * 400 + "</thought>",
                            tokens_per_second=40)])
    llm.script("helper", [thinking_with_actions(30)])
    job_id = start(client, "tester", model)
    child_id = child_job_id(job_id, "kid")  # the one child of that action
    harness.wait_until(lambda: exists(client, child_id), timeout=15,
                       message="the child job never started")
    wait_for_actions(client, child_id, 1)
    client.cancel(job_id)
    assert_cancelled_completely(client, job_id, finish(client, job_id, timeout=15))
    assert_cancelled_completely(client, child_id, finish(client, child_id, timeout=15))
    harness.wait_until(lambda: "streaming" not in llm.outcomes("helper"), timeout=5,
                       message="the child's model stream stayed open")
    assert llm.remaining("helper") == 0
