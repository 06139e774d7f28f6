"""Agent jobs in-process: turns (`coordinator`) against the fake model server of the tests.

`tests/fake_llm.py`'s FakeLLM serves on loopback from a thread of this process; the test
agents' `base_url` is `${CORTEX_TEST_LLM_URL}`, read when a request is made. Each turn task
runs here as the stub takes it, then the actions it sent, then the next turn.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis

from cortex_worker.actions import dispatch
from cortex_worker.jobs import lifecycle as jobs
from cortex_worker.jobs import usage
from cortex_worker.jobs.options import JobOptions
from cortex_worker.jobs.turns import loop as coordinator
from cortex_worker.jobs.turns import waiting
from cortex_worker.store import keys
from cortex_worker.store.keys import JOBS_INDEX
from cortex_worker.store.state import SessionBusy, SessionTurn, Store, TurnStart
from cortex_worker.testing import StubBroker
from tests.engine.helpers import RoundTrips, events, of, one, status
from tests.fake_llm import FakeLLM, Turn

FAST = 5000.0  # tokens per second: a turn streams in a few milliseconds


def act(ident: str, name: str, params: dict[str, Any], mode: str = "sync",
        kind: str = "tool") -> str:
    body = json.dumps({"name": name, "parameters": params})
    return f'<action type="{kind}" mode="{mode}" id="{ident}">{body}</action>'


def turn(text: str) -> Turn:
    return Turn(text=text, tokens_per_second=FAST)


def final(text: str) -> str:
    return f'<response final="true">{text}</response>'


def test_an_agent_runs_an_action_then_answers(store: Store, broker: StubBroker,
                                             llm: FakeLLM) -> None:
    model = f"engine-{uuid.uuid4().hex[:8]}"
    llm.script(model, [
        turn("<thought>Add them.</thought>" + act("sum", "calculator", {"expression": "19 + 23"})),
        turn(final("The sum is $sum.")),
    ])
    job_id = jobs.submit_agent(store, "tester", "Add 19 and 23.", options=JobOptions(model=model))
    assert [m.name for m in broker.messages()] == [dispatch.TURN_TASK]
    broker.join()

    assert status(store, job_id) == "completed"
    assert [m.name for m in broker.ran] == [dispatch.TURN_TASK, dispatch.ACTION_TASK,
                                            dispatch.TURN_TASK]
    log = events(store, job_id)
    assert one(log, "action_completed", "sum")["result"] == 42
    assert [e["data"]["turn"] for e in of(log, "turn_completed")] == [1, 2]
    assert one(log, "response_end") == {"final": True, "text": "The sum is 42."}
    assert log[-1]["data"] == {"status": "completed", "result": "The sum is 42.", "error": None,
                               "turns": 2, "usage": usage.job_usage(store, job_id)}
    assert [counts["requests"] for counts in log[-1]["data"]["usage"].values()] == [2]
    second = llm.requests(model)[1]["messages"]
    assert second[-1] == {"role": "user", "content": '<result id="sum" status="ok">42</result>'}
    assert llm.remaining(model) == 0


def test_a_jobs_turns_reach_the_model_over_one_connection(
        store: Store, broker: StubBroker, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each turn's stream is read to its end, so the next turn's request reuses the kept-alive
    connection instead of opening one (against a real provider, also a TLS handshake). The
    actions are async: a sync action stops the generation and closes its stream, which keeps
    the connection only if the rest of the answer happened to have arrived already (a model
    writes on after the action); a run with a CPU hog saw two connections then."""
    model = f"engine-{uuid.uuid4().hex[:8]}"
    with FakeLLM() as server:
        monkeypatch.setenv("CORTEX_TEST_LLM_URL", server.url)
        server.script(model, [
            turn(act("a", "calculator", {"expression": "1 + 2"}, mode="async")),
            turn(act("b", "calculator", {"expression": "$a * 2"}, mode="async")),
            turn(final("It is $b."))])
        job_id = jobs.submit_agent(store, "tester", "Go.", options=JobOptions(model=model))
        broker.join()
        assert status(store, job_id) == "completed"
        assert len(server.requests(model)) == 3
        assert server.connections == 1


def test_a_turn_reaches_the_model_in_one_or_two_redis_round_trips(
        store: Store, broker: StubBroker, llm: FakeLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between a turn task's start and its model request lie only Redis round trips, on every
    tool turn's critical path: one takes the turn with the job record (`resume`), one logs
    the last turn's close and this one's start and reads the prompt's inputs (`start_turn`).
    A job's first turn has no turn to close: `resume` begins it too, in one round trip."""
    trips = RoundTrips(store, monkeypatch)
    trips.start_at(store, "resume")  # a turn task begins
    before_request = trips.seen_at(coordinator, "open_stream")
    for _ in range(2):  # the first job also loads the scripts into Redis, once
        model = f"engine-{uuid.uuid4().hex[:8]}"
        llm.script(model, [turn(act("sum", "calculator", {"expression": "19 + 23"})),
                           turn(final("The sum is $sum."))])
        before_request.clear()
        job_id = jobs.submit_agent(store, "tester", "Add.", options=JobOptions(model=model))
        broker.join()
        assert status(store, job_id) == "completed"
    assert before_request == [1, 2]
    assert llm.requests(model)[1]["messages"][-1]["content"] == \
        '<result id="sum" status="ok">42</result>'


def test_a_final_turn_ends_the_job_in_three_redis_round_trips(
        store: Store, broker: StubBroker, llm: FakeLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """From the end of the final turn's stream to `job_completed`, on every job's critical
    path: the turn's end (`end_turn`, which logs the turn's last text chunks with it), taking
    the next turn (`resume`, which finds the job done and brings the record the end's hooks
    need), and the end itself, which logs the last turn's close with it. (It took five: the
    chunks were logged first, and the end read the record again.)"""
    trips = RoundTrips(store, monkeypatch)
    trips.start_at(coordinator, "fail_unseen_dependencies")  # just after the stream ended
    at_close = trips.seen_at(store, "close", after=True)
    for _ in range(2):  # the first job also loads the scripts into Redis, once
        model = f"engine-{uuid.uuid4().hex[:8]}"
        llm.script(model, [turn(final("Done."))])
        job_id = jobs.submit_agent(store, "tester", "Answer.", options=JobOptions(model=model))
        broker.join()
        assert status(store, job_id) == "completed"
    assert at_close[-1] == 3
    kinds = [e["type"] for e in store.events_after(job_id)]
    assert "response_chunk" in kinds or "thought_chunk" in kinds or "text" in kinds, kinds
    assert kinds[-3:] == ["response_end", "turn_completed", "job_completed"]


def test_an_agent_action_runs_a_child_agent(store: Store, broker: StubBroker,
                                            llm: FakeLLM) -> None:
    model = f"engine-{uuid.uuid4().hex[:8]}"
    llm.script(model, [
        turn(act("ask", "helper", {"input": "What is 2+3?"}, kind="agent")),
        turn(final("The helper says: $ask")),
    ])
    llm.script("helper", [turn(act("c", "calculator", {"expression": "2+3"})),
                          turn(final("2+3 = $c"))])
    job_id = jobs.submit_agent(store, "tester", "Delegate.", options=JobOptions(model=model))
    broker.join()

    assert status(store, job_id) == "completed"
    child_id = jobs.child_job_id(job_id, "ask")
    log = events(store, job_id)
    assert one(log, "child_job") == {"action_id": "ask", "job_id": child_id}
    assert one(log, "action_completed", "ask")["result"] == "2+3 = 5"
    assert log[-1]["data"]["result"] == "The helper says: 2+3 = 5"
    child = store.get_job(child_id)
    assert child is not None
    assert (child.kind, child.agent, child.status, child.depth) == ("agent", "helper",
                                                                   "completed", 1)
    assert llm.remaining(model) == 0 and llm.remaining("helper") == 0


def test_a_turn_the_store_failed_is_taken_over_once_its_lease_runs_out(
        store: Store, broker: StubBroker, llm: FakeLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis failing mid-turn (past redis-py's retries) fails the turn task, but this worker
    lives on, so no reconciler would take the turn over: the turn is sent again, due after
    its lease, and that delivery generates it again."""
    model = f"engine-{uuid.uuid4().hex[:8]}"
    llm.script(model, [turn("<thought>Thinking.</thought>" + final("first")),
                       turn("<thought>Again.</thought>" + final("done"))])
    real_emit, real_emit_many, real_end_turn = store.emit, store.emit_many, store.end_turn
    failures: list[str] = []

    def thinking(batch: Any) -> bool:
        return any(kind == "thought_chunk" for kind, _ in batch)

    def emit(job_id: str, batch: Any, **kwargs: Any) -> int:
        if not failures and thinking(batch):
            failures.append(job_id)
            raise redis.ConnectionError("Redis went away")
        return real_emit(job_id, batch, **kwargs)

    def emit_many(batches: Any, **kwargs: Any) -> list[Any]:  # the chunk writer's thread
        if not failures and any(thinking(batch) for batch in batches.values()):
            raise redis.ConnectionError("Redis went away")  # it keeps them for the turn
        return real_emit_many(batches, **kwargs)

    def end_turn(job_id: str, *args: Any, chunks: Any = (), **kwargs: Any) -> bool:
        if not failures and thinking(chunks):  # the turn's last chunks go with its end
            failures.append(job_id)
            raise redis.ConnectionError("Redis went away")
        return real_end_turn(job_id, *args, chunks=chunks, **kwargs)

    monkeypatch.setattr(store, "emit", emit)
    monkeypatch.setattr(store, "emit_many", emit_many)
    monkeypatch.setattr(store, "end_turn", end_turn)
    job_id = jobs.submit_agent(store, "tester", "Think.", options=JobOptions(model=model))
    with pytest.raises(redis.ConnectionError):
        broker.join()
    assert failures == [job_id] and status(store, job_id) == "running"
    again = broker.messages(dispatch.TURN_TASK)
    assert len(again) == 1 and (again[0].countdown or 0) > coordinator.TURN_LEASE_S

    store.set_job(job_id, turn_lease=time.time() - 1)  # the stub's clock passes; so does the lease
    broker.join()
    assert status(store, job_id) == "completed"
    log = events(store, job_id)
    assert one(log, "warning")["kind"] == "turn_restarted"
    assert log[-1]["data"]["result"] == "done"


def test_a_turn_that_starts_after_its_job_ended_logs_its_close_but_never_begins(
        store: Store) -> None:
    """Cancelled between `resume` and the turn's start: the last turn's close is still logged
    and its fields written, but no `turn_started` follows `job_cancelled` and no turn runs;
    its end then closes nothing and reports the job not drained."""
    job_id = f"turns-{uuid.uuid4().hex[:8]}"
    store.create_job(job_id, {"kind": "agent", "agent": "tester"}, ttl=600)
    resumed = store.resume(job_id, "me:1")
    assert resumed is not None and resumed.turn == 1 and resumed.job.status == "running"
    store.append_conversation(job_id, {"role": "user", "content": "hi"})
    inputs = store.start_turn(job_id, begin=[("turn_started", {"turn": 1})], action_ids=[])
    assert inputs.begun and inputs.conversation == [{"role": "user", "content": "hi"}]

    jobs.cancel_job(store, job_id)
    inputs = store.start_turn(job_id, closing=[("turn_completed", {"turn": 1})],
                              fields={"turn_phase": "generating"},
                              begin=[("turn_started", {"turn": 2})], action_ids=["x"])
    assert not inputs.begun and inputs.results == {}
    kinds = [e["type"] for e in events(store, job_id)]
    assert kinds[-2:] == ["job_cancelled", "turn_completed"] and kinds.count("turn_started") == 1
    assert store.peek(job_id, "turn_phase").turn_phase == "generating"
    assert not store.end_turn(job_id, [{"role": "assistant", "content": "late"}], {"final": True},
                              chunks=[("thought_chunk", {"text": "late"})])
    assert status(store, job_id) == "cancelled"
    assert "thought_chunk" not in [e["type"] for e in events(store, job_id)]  # never after the end


def _waiting_turn(store: Store, waiter: str) -> str:
    """An agent job whose turn registered one action and ended, `waiter` waiting for it."""
    job_id = f"wait-{uuid.uuid4().hex[:8]}"
    store.create_job(job_id, {"kind": "agent", "agent": "tester"}, ttl=600)
    assert store.resume(job_id, waiter) is not None
    spec = {"id": "a", "type": "tool", "name": "calculator", "parameters": {}}
    registered = store.register(job_id, [{"id": "a", "spec": json.dumps(spec), "deps": [],
                                          "after": [], "on_error": "fail"}], close=False)
    assert [r["id"] for r in registered.ready] == ["a"]
    assert not store.end_turn(job_id, [], {}, waiter=waiter)
    assert store.peek(job_id, "turn_waiter").turn_waiter == waiter
    return job_id


def _finish_a(store: Store, job_id: str) -> bool:
    """Record action `a`'s end; True if the finisher must act on the drain."""
    done = store.finish(job_id, "a", "ok", {"status": "ok"}, 2, None,
                        ("action_completed", {"action_id": "a", "result": 2}))
    assert done.recorded
    return done.drained


def _drains(store: Store) -> tuple[int, int]:
    counts = store.redis.hmget("cx:metrics", "agent_drains|in_place", "agent_drains|queued")
    return int(counts[0] or 0), int(counts[1] or 0)


def test_a_drain_is_published_to_the_turn_that_waits_for_it(store: Store) -> None:
    """The finisher of the last action hands the drain to the waiting turn's process (no
    task is sent); that turn then takes the next turn with `resume` as a turn task would."""
    waiter = f"here:{uuid.uuid4().hex[:6]}"
    pubsub = store.redis.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.wake_channel(waiter))
    try:
        job_id = _waiting_turn(store, waiter)
        before = _drains(store)
        assert not _finish_a(store, job_id)
        messages = [m for m in (pubsub.get_message(timeout=0.5) for _ in range(3)) if m]
    finally:
        pubsub.close()
    assert [m["data"] for m in messages] == [job_id]
    assert _drains(store) == (before[0] + 1, before[1])
    assert status(store, job_id) == "finishing" and store.peek(job_id, "turn_waiter").turn_waiter == ""
    assert store.unwait(job_id, waiter)  # it stops waiting at that moment: the turn is its own
    resumed = store.resume(job_id, waiter)
    assert resumed is not None and resumed.turn == 2 and resumed.finished == ["a"]


def test_a_drain_nobody_listens_for_is_left_to_the_finisher(store: Store) -> None:
    """A waiter whose process is gone (nothing subscribed to its channel) is skipped: the
    finisher sends the next turn as it does for a turn that did not wait."""
    job_id = _waiting_turn(store, f"gone:{uuid.uuid4().hex[:6]}")
    before = _drains(store)
    assert _finish_a(store, job_id)
    assert _drains(store) == (before[0], before[1] + 1)
    assert status(store, job_id) == "finishing"


def test_a_turn_that_stops_waiting_leaves_the_drain_to_the_finisher(store: Store) -> None:
    waiter = f"here:{uuid.uuid4().hex[:6]}"
    pubsub = store.redis.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.wake_channel(waiter))
    try:
        job_id = _waiting_turn(store, waiter)
        assert not store.unwait(job_id, waiter)
        assert _finish_a(store, job_id)  # its process still listens, but it no longer waits
        assert not any(pubsub.get_message(timeout=0.1) for _ in range(3))
    finally:
        pubsub.close()


def test_a_turn_whose_actions_are_done_at_its_end_does_not_wait(store: Store) -> None:
    job_id = f"wait-{uuid.uuid4().hex[:8]}"
    store.create_job(job_id, {"kind": "agent", "agent": "tester"}, ttl=600)
    assert store.resume(job_id, "me:1") is not None
    assert store.end_turn(job_id, [], {}, waiter="me:1")  # drained at once: it goes on itself
    assert store.peek(job_id, "turn_waiter").turn_waiter == ""


def test_a_session_message_is_recorded_before_its_reply(store: Store, broker: StubBroker,
                                                        llm: FakeLLM) -> None:
    """The session gets the user's message and the job before the job's first turn is sent,
    so a reply that comes at once still follows the message it answers (the API used to
    append the message after submitting: a fast job's reply came first)."""
    model = f"engine-{uuid.uuid4().hex[:8]}"
    llm.script(model, [turn(final("It is 5."))])
    store.create_session("s1", "tester", {}, 60)
    sent: list[list[dict[str, Any]]] = []
    real = dispatch.agent_turn

    def agent_turn(job_id: str, countdown: float | None = None) -> None:
        session = store.get_session("s1")
        assert session is not None
        sent.append(session["messages"])
        real(job_id, countdown)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dispatch, "agent_turn", agent_turn)
        job_id = jobs.submit_agent(store, "tester", "What is 2+3?",
                                   session=SessionTurn("s1", None),
                                   options=JobOptions(model=model))
    broker.join()
    assert sent[0] == [{"role": "user", "content": "What is 2+3?", "job_id": job_id}]
    session = store.get_session("s1")
    assert session is not None and session["jobs"] == [job_id]
    assert [(m["role"], m["content"]) for m in session["messages"]] == [
        ("user", "What is 2+3?"), ("assistant", "It is 5.")]


def test_a_session_takes_one_message_at_a_time(store: Store, broker: StubBroker) -> None:
    """The check that the session's last job has ended and the append of the next one are
    one transaction: a caller that read the session before another message started a job,
    or while its job runs, gets SessionBusy, and no job is created for it."""
    store.create_session("s2", "tester", {}, 60)
    first = jobs.submit_agent(store, "tester", "one", session=SessionTurn("s2", None))
    with pytest.raises(SessionBusy, match="started job") as stale:  # read before `first`
        jobs.submit_agent(store, "tester", "two", session=SessionTurn("s2", None))
    assert stale.value.job_id == first
    with pytest.raises(SessionBusy, match="still running") as running:
        jobs.submit_agent(store, "tester", "two", session=SessionTurn("s2", first))
    assert running.value.job_id == first
    session = store.get_session("s2")
    assert session is not None and session["jobs"] == [first]
    assert [m["content"] for m in session["messages"]] == ["one"]

    jobs.cancel_job(store, first)  # ended: the next message may start its job
    second = jobs.submit_agent(store, "tester", "two", session=SessionTurn("s2", first))
    session = store.get_session("s2")
    assert session is not None and session["jobs"] == [first, second]


def test_callers_racing_for_a_session_start_one_job(store: Store, broker: StubBroker) -> None:
    """Eight callers that all read the idle session, then submit at the same moment."""
    store.create_session("s3", "tester", {}, 60)
    before = store.redis.zcard(JOBS_INDEX)
    gate = threading.Barrier(8)

    def submit(n: int) -> str | None:
        gate.wait()
        try:
            return jobs.submit_agent(store, "tester", f"m{n}", session=SessionTurn("s3", None))
        except SessionBusy:
            return None

    with ThreadPoolExecutor(8) as pool:
        started = [j for j in pool.map(submit, range(8)) if j is not None]
    assert len(started) == 1
    session = store.get_session("s3")
    assert session is not None and session["jobs"] == started
    assert len(session["messages"]) == 1
    assert store.redis.zcard(JOBS_INDEX) == before + 1


def _coordinate_in_place(store: Store, broker: StubBroker, job_id: str) -> threading.Thread:
    """Run the job's turns in a thread, as a threaded agent worker does (each turn waits in
    place for its actions), and its actions here, until the job ends."""
    waiting.wait_in_place(4)
    try:
        coordinating = threading.Thread(target=coordinator.run_turns, args=(store, job_id))
        coordinating.start()
        deadline = time.monotonic() + 30
        while coordinating.is_alive():
            assert time.monotonic() < deadline, "the job did not end"
            if broker.messages(dispatch.ACTION_TASK, queue=None) and broker.pending:
                broker.join()  # the actions run here; the drain wakes the waiting thread
            time.sleep(0.01)
        broker.join()
    finally:
        waiting.wait_in_place(0)
    return coordinating


def test_a_turn_that_waited_in_place_is_begun_by_resume(store: Store, broker: StubBroker,
                                                         llm: FakeLLM,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn whose thread waited in place for its actions knows how the next turn starts
    (nothing to render, no final response): `resume` begins it in the same round trip, so
    one round trip lies between the drain and the model request (it took two: `resume`,
    then `start_turn`). The events and the prompt are as before."""
    model = f"engine-{uuid.uuid4().hex[:8]}"
    llm.script(model, [turn(act("sum", "calculator", {"expression": "19 + 23"})),
                       turn(final("The sum is $sum."))])
    starts: list[int] = []
    real_start = store.start_turn

    def start_turn(job_id: str, **kwargs: Any) -> Any:
        starts.append(len(kwargs.get("begin") or ()))
        return real_start(job_id, **kwargs)

    monkeypatch.setattr(store, "start_turn", start_turn)
    job_id = jobs.submit_agent(store, "tester", "Add.", options=JobOptions(model=model))
    coordinating = _coordinate_in_place(store, broker, job_id)
    assert not coordinating.is_alive()
    assert status(store, job_id) == "completed"
    assert starts == []  # resume began turn 1 (with job_started), and turn 2
    kinds = [e["type"] for e in store.events_after(job_id)]
    assert kinds.count("turn_started") == 2
    assert kinds.index("action_completed") < kinds.index("turn_completed") < \
        len(kinds) - 1 - kinds[::-1].index("turn_started")
    assert llm.requests(model)[1]["messages"][-1]["content"] == \
        '<result id="sum" status="ok">42</result>'
    assert store.get_job(job_id).result == "The sum is 42."


def test_resume_begins_a_known_start_only_if_the_record_agrees(store: Store) -> None:
    """A `TurnStart` for another turn, or for a job whose last turn left responses to render
    or a final response, is not begun: `resume` only takes the turn, and logs nothing."""
    start = TurnStart(2, closing=[("turn_completed", {"turn": 1})],
                      fields={"pending_responses": [], "turn_phase": "generating"},
                      begin=[("turn_started", {"turn": 2})])
    for case, fields in [("pending", {"turn": 1, "pending_responses": [{"final": False,
                                                                         "text": "$x"}]}),
                         ("final", {"turn": 1, "final": True}),
                         ("other turn", {"turn": 2})]:
        job_id = f"known-{uuid.uuid4().hex[:8]}"
        store.create_job(job_id, {"kind": "agent", "agent": "tester", "status": "finishing",
                                  **fields}, ttl=600)
        resumed = store.resume(job_id, "me:1", start=start)
        assert resumed is not None and resumed.inputs is None, case
        assert events(store, job_id) == [], case
        assert store.peek(job_id, "turn_phase").turn_phase == "resumed", case

    job_id = f"known-{uuid.uuid4().hex[:8]}"
    store.create_job(job_id, {"kind": "agent", "agent": "tester", "status": "finishing",
                              "turn": 1}, ttl=600)
    store.append_conversation(job_id, {"role": "user", "content": "hi"})
    resumed = store.resume(job_id, "me:1", start=start)
    assert resumed is not None and resumed.inputs is not None and resumed.inputs.begun
    assert resumed.inputs.conversation == [{"role": "user", "content": "hi"}]
    assert [e["type"] for e in events(store, job_id)] == ["turn_completed", "turn_started"]
    assert store.peek(job_id, "turn_phase").turn_phase == "generating"


def test_a_turn_that_waited_in_place_still_stops_at_max_turns(store: Store, broker: StubBroker,
                                                              llm: FakeLLM) -> None:
    """A thread that knows how the last turn closes still checks the agent's limits: after
    `max_turns` (4 for `tester`) turns of actions, the job fails instead of a fifth turn."""
    model = f"engine-{uuid.uuid4().hex[:8]}"
    llm.script(model, [turn(act(f"s{n}", "calculator", {"expression": f"{n} + 1"}))
                       for n in range(5)])
    job_id = jobs.submit_agent(store, "tester", "Count.", options=JobOptions(model=model))
    _coordinate_in_place(store, broker, job_id)
    job = store.get_job(job_id)
    assert job is not None and job.status == "failed", job
    assert "max_turns (4)" in job.error
    assert len(llm.requests(model)) == 4


# ---------------------------------------------------------------- moved from tests/integration


def test_a_failing_model_is_asked_max_retries_plus_one_times(store: Store, broker: StubBroker,
                                                             llm: FakeLLM) -> None:
    model = f"engine-{uuid.uuid4().hex[:8]}"
    llm.script(model, [Turn(fail_status=500, error_message="backend down")] * 8)
    job_id = jobs.submit_agent(store, "retrier", "go",  # max_retries: 2
                               options=JobOptions(model=model))
    broker.join()
    log = events(store, job_id)
    assert log[-1]["type"] == "job_failed"
    assert "3 attempts made; max_retries is 2" in log[-1]["data"]["error"]
    assert len(llm.requests(model)) == 3
    assert of(log, "warning") == []  # no turn restart: nothing streamed


def test_a_stream_that_breaks_after_output_restarts_the_turn_once(
        store: Store, broker: StubBroker, llm: FakeLLM) -> None:
    model = f"engine-{uuid.uuid4().hex[:8]}"
    broken = Turn(text="<thought>a long enough thought to break</thought>", fail_after_chars=12)
    llm.script(model, [broken, broken, broken])
    job_id = jobs.submit_agent(store, "retrier", "go", options=JobOptions(model=model))
    broker.join()
    log = events(store, job_id)
    assert log[-1]["type"] == "job_failed"
    assert "restarted 1 time(s)" in log[-1]["data"]["error"]
    assert len(llm.requests(model)) == 2
    assert [e["data"]["kind"] for e in of(log, "warning")] == ["model_retry"]



def test_tool_choice_required_holds_until_the_job_has_run_an_action(
        store: Store, broker: StubBroker, llm: FakeLLM) -> None:
    """`tool_choice: required` (agent `must_act`, native tools): the first turn's request
    says `required`; once an action ran, the next says nothing (auto), so the model answers."""
    model = f"must-act-{uuid.uuid4().hex[:8]}"
    llm.script(model, [
        Turn(tool_calls=[{"id": "call_1", "name": "calculator",
                          "arguments": {"expression": "6 * 7"}}], tokens_per_second=5000),
        Turn(text="It is 42.", tokens_per_second=5000)])
    job_id = jobs.submit_agent(store, "must_act", "6 * 7?", options=JobOptions(model=model))
    broker.join()
    assert status(store, job_id) == "completed"
    first, second = llm.requests(model)
    assert first["tool_choice"] == "required" and first["tools"]
    assert "tool_choice" not in second and second["tools"]
    assert events(store, job_id)[-1]["data"]["result"] == "It is 42."


def test_a_tool_named_by_tool_choice_is_forced_until_the_job_has_run_an_action(
        store: Store, broker: StubBroker, llm: FakeLLM) -> None:
    """`tool_choice: calculator` (agent `must_calculate`): the first request forces that
    function; once an action ran, the next says nothing (auto)."""
    model = f"must-calculate-{uuid.uuid4().hex[:8]}"
    llm.script(model, [
        Turn(tool_calls=[{"id": "call_1", "name": "calculator",
                          "arguments": {"expression": "6 * 7"}}], tokens_per_second=5000),
        Turn(text="It is 42.", tokens_per_second=5000)])
    job_id = jobs.submit_agent(store, "must_calculate", "6 * 7?",
                               options=JobOptions(model=model))
    broker.join()
    assert status(store, job_id) == "completed"
    first, second = llm.requests(model)
    assert first["tool_choice"] == {"type": "function", "function": {"name": "calculator"}}
    assert "tool_choice" not in second


def test_a_typed_output_is_the_jobs_value_and_a_wrong_one_is_answered_again(
        store: Store, broker: StubBroker, llm: FakeLLM) -> None:
    """Agent `reporter` (output_schema): a final response that is not the schema's is refused
    (a `warning` records it; the model's next turn is told which field), and the one that
    matches, fenced or not, is the job's result as a value, in its end event and its view."""
    from cortex_api.models import JobView

    model = f"typed-{uuid.uuid4().hex[:8]}"
    llm.script(model, [turn(final('{"answer": "forty-two"}')),
                       turn(final('```json\n{"answer": 42, "unit": "apples"}\n```'))])
    job_id = jobs.submit_agent(store, "reporter", "How many?", options=JobOptions(model=model))
    broker.join()
    assert status(store, job_id) == "completed"
    log = events(store, job_id)
    rejected = one(log, "warning")
    assert rejected["kind"] == "output_rejected" and "field answer" in rejected["message"]
    assert rejected["answer"] == '{"answer": "forty-two"}'
    told = llm.requests(model)[1]["messages"][-1]["content"]
    assert "field answer" in told and "is not of type 'integer'" in told
    assert log[-1]["type"] == "job_completed"
    assert log[-1]["data"]["result"] == {"answer": 42, "unit": "apples"}
    view = JobView.from_store(store.get_job(job_id))  # type: ignore[arg-type]
    assert view.result == {"answer": 42, "unit": "apples"}


def test_a_typed_output_that_never_matches_fails_the_job_naming_the_field(
        store: Store, broker: StubBroker, llm: FakeLLM) -> None:
    model = f"typed-{uuid.uuid4().hex[:8]}"
    llm.script(model, [turn(final("forty-two")) for _ in range(3)])
    job_id = jobs.submit_agent(store, "reporter", "How many?", options=JobOptions(model=model))
    broker.join()
    assert status(store, job_id) == "failed"
    end = events(store, job_id)[-1]
    assert end["type"] == "job_failed"
    assert "max_turns (3) reached" in end["data"]["error"]
    assert "not JSON" in end["data"]["error"]
