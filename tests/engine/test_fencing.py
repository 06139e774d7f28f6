"""Fencing: a lease holder that was paused, and woke up after its lease was taken over,
changes nothing (issue 31). Every write carries the holder's number (an action's attempt, a
turn's fence) and the store's script refuses a stale one in the same call."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from cortex_worker.actions import dispatch
from cortex_worker.jobs import lifecycle as jobs
from cortex_worker.jobs.options import JobOptions
from cortex_worker.jobs.turns import loop as coordinator
from cortex_worker.observability.metrics import CortexCollector
from cortex_worker.recovery import fencing
from cortex_worker.store.state import Fenced, Store
from cortex_worker.testing import StubBroker
from tests.engine.helpers import events, of, one, status
from tests.fake_llm import FakeLLM, Turn

PAUSED = "host-a:101"  # the holder that was paused
OTHER = "host-b:202"  # the one that took over


def _stale_writes(store: Store) -> dict[str, float]:
    collector = CortexCollector(store.redis)
    family = next(f for f in collector.collect() if f.name == "cortex_stale_writes")
    return {s.labels["write"]: s.value for s in family.samples if s.name.endswith("_total")}


def _job_with_action(store: Store) -> str:
    job_id = f"fence-{uuid.uuid4().hex[:8]}"
    store.create_job(job_id, {"kind": "document"}, ttl=600)
    assert store.begin(job_id, []) == "started"
    spec = {"id": "a", "type": "tool", "name": "echo"}
    ready = store.register(job_id, [{"id": "a", "spec": json.dumps(spec), "deps": [],
                                     "after": [], "on_error": "fail"}], close=True).ready
    assert [r["id"] for r in ready] == ["a"]
    return job_id


def _finish(store: Store, job_id: str, value: str, attempt: int, holder: str) -> bool:
    return store.finish(job_id, "a", "ok", {"status": "ok", "value": value, "attempt": attempt},
                        value, None, ("action_completed", {"action_id": "a", "result": value}),
                        attempt=attempt, holder=holder).recorded


def test_a_stale_attempt_woken_after_the_action_was_run_again_records_nothing(
        store: Store) -> None:
    job_id = _job_with_action(store)
    assert store.claim(job_id, "a", PAUSED, 60.0)[:2] == ["run", 1]
    # PAUSED stops beating; the reconciler releases its lease and sends the action again
    assert store.redrive(job_id, "a", PAUSED, "worker died", 3)[0] == "send"
    with pytest.raises(Fenced):  # woken before anyone claimed it: its lease is gone already
        _finish(store, job_id, "from the paused attempt", 1, PAUSED)
    assert store.claim(job_id, "a", OTHER, 60.0)[:2] == ["run", 2]
    with pytest.raises(Fenced):
        _finish(store, job_id, "from the paused attempt", 1, PAUSED)
    with pytest.raises(Fenced):  # nor may it send the action to run again
        store.retry(job_id, "a", {"action_id": "a"}, attempt=1, holder=PAUSED)
    assert _finish(store, job_id, "from attempt 2", 2, OTHER)

    action = store.actions(job_id)["a"]
    assert action["attempts"] == 2
    assert action["result"]["value"] == "from attempt 2" and action["result"]["attempt"] == 2
    assert [e["data"]["result"] for e in of(events(store, job_id), "action_completed")] == [
        "from attempt 2"]
    assert store.get_job(job_id).status == "finishing"  # type: ignore[union-attr]
    assert _stale_writes(store) == {"result": 2, "retry": 1}


def test_an_attempt_woken_before_anyone_took_it_over_still_records(store: Store) -> None:
    job_id = _job_with_action(store)
    assert store.claim(job_id, "a", PAUSED, 60.0)[:2] == ["run", 1]
    assert _finish(store, job_id, "late but current", 1, PAUSED)
    assert store.redrive(job_id, "a", PAUSED, "worker died", 3) == ("", None)  # nothing to do
    assert store.actions(job_id)["a"]["result"]["value"] == "late but current"
    assert _stale_writes(store) == {}


def test_the_heartbeats_check_stops_an_attempt_run_again_elsewhere(store: Store) -> None:
    """A woken worker kills what it runs for a stale attempt (its sandbox registers the stop),
    and leaves a current attempt alone."""
    from cortex_worker.recovery.owners import owner

    job_id = _job_with_action(store)
    assert store.claim(job_id, "a", owner(), 60.0)[:2] == ["run", 1]
    stopped: list[str] = []
    with fencing.holding(job_id, "a", 1) as held:
        held.on_stale(lambda: stopped.append("killed"))
        assert fencing.check(store) == 0 and stopped == []  # still its own
        assert store.redrive(job_id, "a", owner(), "worker died", 3)[0] == "send"
        assert store.claim(job_id, "a", OTHER, 60.0)[:2] == ["run", 2]
        assert fencing.check(store) == 1 and stopped == ["killed"]
        assert fencing.check(store) == 1 and stopped == ["killed"]  # stopped once
        held.on_stale(lambda: stopped.append("late"))  # registered after: runs at once
        assert stopped == ["killed", "late"]


def test_the_heartbeats_check_stops_an_attempt_whose_job_was_cancelled(store: Store) -> None:
    from cortex_worker.recovery.owners import owner

    job_id = _job_with_action(store)
    assert store.claim(job_id, "a", owner(), 60.0)[0] == "run"
    stopped: list[str] = []
    with fencing.holding(job_id, "a", 1) as held:
        held.on_stale(lambda: stopped.append("killed"))
        assert store.close(job_id, "cancelled") is not None
        assert fencing.check(store) == 1 and stopped == ["killed"]


def _agent_job(store: Store) -> str:
    job_id = f"fence-turn-{uuid.uuid4().hex[:8]}"
    store.create_job(job_id, {"kind": "agent", "agent": "tester"}, ttl=600)
    return job_id


def test_a_turn_taken_over_refuses_every_write_of_its_paused_coordinator(store: Store) -> None:
    job_id = _agent_job(store)
    first = store.resume(job_id, PAUSED, 30.0)
    assert first is not None and first.turn == 1
    old = first.job.turn_fence
    store.start_turn(job_id, begin=[("turn_started", {"turn": 1})], fence=old)
    store.emit(job_id, [("thought_chunk", {"text": "before the pause "})], live=True, fence=old)
    # PAUSED stops beating: another coordinator takes the turn over and generates it again
    taken = store.resume(job_id, OTHER, 30.0, dead_owner=PAUSED)
    assert taken is not None and taken.restarted and taken.job.turn_fence > old
    new = taken.job.turn_fence
    store.emit(job_id, [("thought_chunk", {"text": "regenerated"})], live=True, fence=new)

    seq = events(store, job_id)[-1]["seq"]
    with pytest.raises(Fenced):
        store.emit(job_id, [("thought_chunk", {"text": "after the wake"})], live=True, fence=old)
    assert store.emit_many({(job_id, old): [("thought_chunk", {"text": "buffered"})]},
                           live=True) == [(job_id, old)]
    with pytest.raises(Fenced):
        store.register(job_id, [{"id": "x", "spec": '{"id": "x", "type": "tool"}', "deps": [],
                                 "after": [], "on_error": "fail"}], close=False, fence=old)
    with pytest.raises(Fenced):
        store.finish(job_id, "x", "error", {"status": "error"}, None, None,
                     ("action_failed", {"action_id": "x"}), fence=old)
    with pytest.raises(Fenced):
        store.end_turn(job_id, [{"role": "assistant", "content": "stale"}], {"final": True},
                       [("usage", {"turn": 1, "prompt_tokens": 1, "completion_tokens": 1})],
                       chunks=[("thought_chunk", {"text": "last"})], fence=old)
    assert not store.renew_turn(job_id, old, 30.0)
    assert not store.yield_turn(job_id, PAUSED, old)
    assert store.close(job_id, "failed", {"error": "stale"}, fence=old) is None

    assert events(store, job_id)[-1]["seq"] == seq  # nothing was logged
    job = store.get_job(job_id)
    assert job is not None and job.status == "running" and job.turn_owner == OTHER
    assert not job.final and store.conversation(job_id) == []
    assert store.spec(job_id, "x") is None
    assert store.renew_turn(job_id, new, 30.0)  # the new owner goes on
    assert store.end_turn(job_id, [], {"final": True}, fence=new)
    assert _stale_writes(store) == {"events": 2, "register": 1, "result": 1, "turn_end": 1,
                                    "turn_renew": 1, "turn_yield": 1, "job_end": 1}


def test_a_turns_end_logs_nothing_once_its_job_has_ended(store: Store) -> None:
    """`usage` and the other events of a turn's end are not logged after the job's end."""
    job_id = _agent_job(store)
    resumed = store.resume(job_id, PAUSED, 30.0)
    assert resumed is not None
    assert store.close(job_id, "cancelled", events=[("job_cancelled", {})]) is not None
    seq = events(store, job_id)[-1]["seq"]
    assert not store.end_turn(job_id, [], {}, [("usage", {"turn": 1, "prompt_tokens": 1,
                                                          "completion_tokens": 1})],
                              fence=resumed.job.turn_fence)
    assert events(store, job_id)[-1]["seq"] == seq


def test_a_chunk_writer_tells_the_turn_its_buffered_chunks_were_refused(store: Store) -> None:
    """Chunks buffered when the pause began are written on waking: refused, and the turn's
    reader learns it must stop."""
    from cortex_worker.store.chunk_writer import ChunkWriter

    job_id = _agent_job(store)
    old = store.resume(job_id, PAUSED, 30.0).job.turn_fence  # type: ignore[union-attr]
    store.resume(job_id, OTHER, 30.0, dead_owner=PAUSED)
    writer = ChunkWriter(store, 0.01, on_stale=fencing.turn_lost)
    with fencing.turn(job_id, old):
        writer.add(job_id, [("thought_chunk", {"text": "buffered at the pause"})], old)
        deadline = time.monotonic() + 30
        while not fencing.is_lost(job_id, old) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fencing.is_lost(job_id, old)
    assert not fencing.is_lost(job_id, old)  # forgotten once the turn's thread stops
    assert of(events(store, job_id), "thought_chunk") == []


def test_a_stale_attempt_s_sandboxed_process_is_killed_and_its_outcome_dropped(
        store: Store) -> None:
    """The woken worker's heartbeat finds its attempt stale: the `python` tool's sandbox is
    killed (not left to run its minute), and what it returns is refused."""
    import threading

    from cortex_worker.actions import executor
    from cortex_worker.recovery.owners import owner
    from cortex_worker.sandbox import process

    job_id = f"fence-{uuid.uuid4().hex[:8]}"
    store.create_job(job_id, {"kind": "document"}, ttl=600)
    assert store.begin(job_id, []) == "started"
    spec = {"id": "a", "type": "tool", "name": "python",
            "parameters": {"code": "import time\ntime.sleep(600)"}}
    store.register(job_id, [{"id": "a", "spec": json.dumps(spec), "deps": [], "after": [],
                             "on_error": "fail"}], close=True)
    outcome: list[str] = []
    running = threading.Thread(target=lambda: outcome.append(
        executor.execute(job_id, "a", spec, trigger=True)))
    before = process.live_groups()
    running.start()
    try:
        deadline = time.monotonic() + 60
        while process.live_groups() == before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process.live_groups() != before, "the python tool never started"
        assert store.redrive(job_id, "a", owner(), "worker died", 3)[0] == "send"
        assert store.claim(job_id, "a", OTHER, 60.0)[:2] == ["run", 2]
        assert fencing.check(store) == 1
        running.join(60)
        assert not running.is_alive() and outcome == ["stale"]
    finally:
        process.kill_all()
        running.join(10)
    action = store.actions(job_id)["a"]
    assert action["status"] == "running" and action["result"] is None  # attempt 2's to record
    assert of(events(store, job_id), "action_failed") == []


GONE = "gone-host:77"  # a coordinator of another host that stopped beating: dead


def _stopped_mid_answer(store: Store, agent: str, model: str, streamed: str,
                        logged: str) -> str:
    """An agent job (on `model`) whose turn 1 a coordinator (GONE) began and streamed
    `streamed` of (with `logged` as its thought chunk), then stopped: its turn task is due."""
    job_id = jobs.submit_agent(store, agent, "Go.", options=JobOptions(model=model))
    resumed = store.resume(job_id, GONE, 30.0, start=coordinator.FIRST_TURN)
    assert resumed is not None and resumed.inputs is not None and resumed.inputs.begun
    fence = resumed.job.turn_fence
    store.emit(job_id, [("thought_chunk", {"text": logged})], live=True, fence=fence,
               streamed=streamed)
    return job_id


def test_a_turn_taken_over_goes_on_from_the_answer_already_streamed(
        store: Store, broker: StubBroker, llm: FakeLLM) -> None:
    """With `continuation`, the new coordinator sends the partial answer as a prefill and
    logs only what follows: a client joining the thought chunks reads each word once."""
    thought = "<thought>Thinking with care about the question.</thought>"
    answer = '<response final="true">42</response>'
    model = f"continuer-{uuid.uuid4().hex[:8]}"
    llm.script(model, [Turn(text=thought + answer, tokens_per_second=5000)])
    job_id = _stopped_mid_answer(store, "continuer", model, "<thought>Thinking with ",
                                 "Thinking with ")
    dispatch.agent_turn(job_id)
    broker.join()

    assert status(store, job_id) == "completed"
    log = events(store, job_id)
    warning = one(log, "warning")
    assert warning["kind"] == "turn_restarted" and warning["continued"] is True
    thinking = "".join(e["data"]["text"] for e in of(log, "thought_chunk"))
    assert thinking == "Thinking with care about the question."
    (request,) = llm.requests(model)
    assert request["messages"][-1] == {"role": "assistant", "content": "<thought>Thinking with"}
    assert store.conversation(job_id)[-1] == {"role": "assistant", "content": thought + answer}
    assert log[-1]["type"] == "job_completed" and log[-1]["data"]["result"] == "42"


def test_a_partial_answer_whose_action_was_registered_is_not_registered_again(
        store: Store, broker: StubBroker, llm: FakeLLM) -> None:
    """The stopped coordinator had parsed and registered a sync action: the continuation
    replays it (no second registration, no second run) and the turn ends at it."""
    act = '<action type="tool" mode="sync" id="calc">{"name": "calculator", ' \
          '"parameters": {"expression": "6 * 7"}}</action>'
    model = f"continuer-{uuid.uuid4().hex[:8]}"
    llm.script(model, [Turn(text='<response final="true">42</response>', tokens_per_second=5000)])
    job_id = _stopped_mid_answer(store, "continuer", model, act + "\n", "")
    dispatch.agent_turn(job_id)
    broker.join()
    assert status(store, job_id) == "completed"
    log = events(store, job_id)
    assert len(of(log, "action_started", "calc")) == 1
    assert one(log, "action_completed", "calc")["result"] == 42
    assert len(llm.requests(model)) == 1  # the turn ended at its sync action: no stream
    assert log[-1]["data"]["result"] == "42"


def test_a_turn_taken_over_without_continuation_is_generated_again_and_says_so(
        store: Store, broker: StubBroker, llm: FakeLLM) -> None:
    model = f"tester-{uuid.uuid4().hex[:8]}"
    llm.script(model, [Turn(text='<response final="true">done</response>', tokens_per_second=5000)])
    job_id = _stopped_mid_answer(store, "tester", model, "<thought>Half", "Half")
    dispatch.agent_turn(job_id)
    broker.join()
    assert status(store, job_id) == "completed"
    warning = one(events(store, job_id), "warning")
    assert warning["continued"] is False and "generated again" in warning["message"]
    assert llm.requests(model)[-1]["messages"][-1]["role"] == "user"


def test_a_takeover_names_the_coordinator_it_took_the_turn_from(store: Store) -> None:
    job_id = _agent_job(store)
    assert store.resume(job_id, PAUSED, 30.0) is not None
    taken = store.resume(job_id, OTHER, 30.0, dead_owner=PAUSED)
    assert taken is not None and taken.job.turn_owner == OTHER
    assert taken.job.turn_taken_from == PAUSED
