"""Messages sent ahead of a finish (in-process engine, real Redis).

An action's claim foresees the dependents its success alone makes ready; their messages go out
while its finish is on its way to Redis, so a hop does not wait for the finish's round trip.
A message that still comes first is dropped, marked, and that finish sends it again: each
action runs once, after the end it waits for, whichever lands first.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from cortex_worker.actions import dispatch, executor
from cortex_worker.jobs import lifecycle as jobs
from cortex_worker.jobs.options import JobOptions
from cortex_worker.store.keys import job_keys
from cortex_worker.store.state import Store, dumps
from cortex_worker.testing import Message, StubBroker
from tests.engine.helpers import action, events, of

READINESS = JobOptions(canvas=False)


def chain(n: int) -> str:
    return action("c0", "echo", {"message": 0}) + "".join(
        action(f"c{i}", "echo", {"message": f"$c{i - 1}"}, depends_on=[f"c{i - 1}"])
        for i in range(1, n))


def action_messages(broker: StubBroker, action_id: str) -> list[Message]:
    return [m for m in broker.sent if m.name == dispatch.ACTION_TASK and m.args[1] == action_id]


def test_each_dependent_goes_ahead_once_and_runs_after_the_end_it_waits_for(
        store: Store, broker: StubBroker) -> None:
    job_id = jobs.submit_document(store, chain(4), options=READINESS)
    broker.join()
    log = events(store, job_id)
    assert log[-1]["type"] == "job_completed"
    for i in range(1, 4):
        (message,) = action_messages(broker, f"c{i}")  # sent once: ahead, not again after
        assert message.args[3:] == [True, True]  # readiness, and ahead of c{i-1}'s finish
        kinds = [(e["type"], e["data"].get("action_id")) for e in log]
        assert kinds.index(("action_completed", f"c{i - 1}")) \
            < kinds.index(("action_queued", f"c{i}")) < kinds.index(("action_started", f"c{i}"))
    assert of(log, "action_completed", "c3")[0]["data"]["result"] == 0  # $c2, resolved
    assert [a["attempts"] for a in store.actions(job_id).values()] == [1, 1, 1, 1]


def test_a_message_that_comes_before_the_finish_is_sent_again_by_it(
        store: Store, broker: StubBroker, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worst order: each message sent ahead runs before its dependency's finish reaches
    Redis (a finishing worker paused between the two)."""
    overlapped = Store._overlapped

    def ahead_first(self: Store, name: str, keys: Any, argv: Any, meanwhile: Any) -> Any:
        meanwhile()
        for message in [m for m in broker.pending if m.args[4:] == [True]]:
            assert broker.run(message) == "blocked"
        return overlapped(self, name, keys, argv, lambda: None)

    monkeypatch.setattr(Store, "_overlapped", ahead_first)
    job_id = jobs.submit_document(store, chain(3), options=READINESS)
    broker.join()
    log = events(store, job_id)
    assert log[-1]["type"] == "job_completed"
    for i in (1, 2):
        early, again = action_messages(broker, f"c{i}")
        assert early.args[4:] == [True] and early.value == "blocked"
        assert again.args[4:] == [] and again.value == "ok"  # the finish sent it again
        assert len(of(log, "action_started", f"c{i}")) == 1
    assert [a["attempts"] for a in store.actions(job_id).values()] == [1, 1, 1]
    assert not store.redis.hgetall(f"cx:{{{job_id}}}:tm")  # no mark is left behind


def _plan(store: Store, job_id: str, entries: list[dict[str, Any]], limit: int = 100) -> None:
    store.create_job(job_id, {"kind": "document", "limit": str(limit)}, 600)
    store.set_job(job_id, status="running")
    store.register(job_id, [{"spec": dumps({"id": e["id"], "type": "tool", "name": "echo"}),
                             "after": [], "on_error": e.get("on_error", "stop"), **e}
                            for e in entries], close=True)


def _foreseen(claim: list[Any], names: int = 0) -> list[str]:
    assert claim[0] == "run"
    return [json.loads(spec)["id"] for spec in claim[2 + names:]]


def test_a_claim_foresees_only_what_its_success_alone_makes_ready(store: Store) -> None:
    job_id = "ahead-foresee"
    _plan(store, job_id, [{"id": "a", "deps": []}, {"id": "b", "deps": []},
                          {"id": "x", "deps": ["a"]}, {"id": "y", "deps": ["a", "b"]},
                          {"id": "z", "deps": ["b"]}])
    assert _foreseen(store.claim(job_id, "a", "w:1", 60, foresee=8)) == ["x"]  # y waits for b
    store.finish(job_id, "a", "ok", {"status": "ok"}, 1, None,
                 ("action_completed", {"action_id": "a"}))
    assert set(_foreseen(store.claim(job_id, "b", "w:1", 60, foresee=8))) == {"y", "z"}
    assert _foreseen(store.claim(job_id, "x", "w:1", 60, foresee=8)) == []  # no dependents


def test_a_claim_foresees_nothing_a_failure_poisons_nor_past_the_jobs_parallelism(
        store: Store) -> None:
    job_id = "ahead-poison"
    _plan(store, job_id, [{"id": "a", "deps": []}, {"id": "b", "deps": []},
                          {"id": "c", "deps": ["a", "b"]}])
    store.claim(job_id, "b", "w:1", 60)
    store.finish(job_id, "b", "error", {"status": "error"}, {"error": "no"}, None,
                 ("action_failed", {"action_id": "b"}))
    assert _foreseen(store.claim(job_id, "a", "w:1", 60, foresee=8)) == []  # c is skipped
    job_id = "ahead-limit"
    _plan(store, job_id, [{"id": "a", "deps": []}, {"id": "b", "deps": []},
                          {"id": "c", "deps": ["a"]}, {"id": "d", "deps": ["a"]}], limit=2)
    store.claim(job_id, "b", "w:1", 60)  # a and b run: a's end frees one place
    assert len(_foreseen(store.claim(job_id, "a", "w:1", 60, foresee=8))) == 1


def test_a_message_sent_ahead_waits_for_its_place_under_the_jobs_parallelism(
        store: Store) -> None:
    """One sent ahead of a finish that parks it (the job's `max_parallel` is full) is not
    run: it is marked, and the finish that gives it a place sends it."""
    job_id = "ahead-parked"
    _plan(store, job_id, [{"id": "a", "deps": []}, {"id": "b", "deps": []},
                          {"id": "c", "deps": ["a"]}], limit=2)
    store.claim(job_id, "a", "w:1", 60)
    store.claim(job_id, "b", "w:1", 60)
    # a's end would free its place; another action takes it before c (a register, say)
    store.redis.hincrby(job_keys(job_id).job, "running", 1)
    done = store.finish(job_id, "a", "ok", {"status": "ok"}, 1, None,
                        ("action_completed", {"action_id": "a"}), ahead=["c"])
    assert done.ready == [] and store.redis.hget(job_keys(job_id).status, "c") == "waiting"
    assert store.claim(job_id, "c", "w:1", 60, ahead=True) == ["blocked"]
    store.redis.hincrby(job_keys(job_id).job, "running", -1)
    freed = store.finish(job_id, "b", "ok", {"status": "ok"}, 1, None,
                         ("action_completed", {"action_id": "b"}))
    assert [s["id"] for s in freed.ready] == ["c"]
    assert store.claim(job_id, "c", "w:1", 60)[0] == "run"


def test_the_finish_is_recorded_once_when_its_overlapped_send_finds_no_script(
        store: Store) -> None:
    """A new master without the scripts loaded: the finish runs the usual way, once."""
    job_id = "ahead-noscript"
    _plan(store, job_id, [{"id": "a", "deps": []}, {"id": "b", "deps": ["a"]}])
    store.claim(job_id, "a", "w:1", 60, foresee=8)
    store.redis.script_flush()
    calls: list[str] = []
    done = store.finish(job_id, "a", "ok", {"status": "ok"}, 1, None,
                        ("action_completed", {"action_id": "a"}), ahead=["b"],
                        send_ahead=lambda: calls.append("sent"))
    assert calls == ["sent"] and done.recorded and done.ready == []
    assert store.claim(job_id, "b", "w:1", 60, ahead=True)[0] == "run"
    assert store.redis.hget(job_keys(job_id).status, "a") == "ok"


def test_a_canvas_step_sent_ahead_that_comes_first_keeps_its_place(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """It comes back soon (its task retries, doubling the wait); a step that is not ready
    for another reason (a child job records the action before it) is dropped as before."""

    class Blocked:
        def spec(self, job_id: str, action_id: str) -> dict[str, Any]:
            return {"id": action_id, "type": "tool", "name": "echo", "parameters": {}}

        def claim(self, *args: Any, **kwargs: Any) -> list[str]:
            return ["blocked"]

    class Again(Exception):
        pass

    countdowns: list[float] = []

    def again(countdown: float) -> Any:
        countdowns.append(countdown)
        raise Again

    monkeypatch.setattr(executor, "get_store", lambda: Blocked())
    for tries in (0, 3):
        with pytest.raises(Again):
            executor.execute("j", "b", None, False,
                             executor.Delivery(again=again, tries=tries, ahead=True))
    assert countdowns == [executor.EARLY_RETRY_S, executor.EARLY_RETRY_S * 8]
    assert executor.execute("j", "b", None, False, executor.Delivery(again=again)) == "blocked"


def test_a_claim_looks_at_a_bounded_number_of_dependents(store: Store) -> None:
    """An action with many dependents that wait for another action too is not walked at each
    claim: at most 8 looks per dependent asked for (its finish walks them all)."""
    job_id = "ahead-bounded"
    many = [{"id": f"d{i}", "deps": ["a", "b"]} for i in range(20)]
    _plan(store, job_id, [{"id": "a", "deps": []}, {"id": "b", "deps": []}, *many,
                          {"id": "last", "deps": ["a"]}])
    assert _foreseen(store.claim(job_id, "a", "w:1", 60, foresee=2)) == []  # 16 looks: d0-d15
    job_id = "ahead-bounded-near"
    _plan(store, job_id, [{"id": "a", "deps": []}, {"id": "b", "deps": []}, *many[:5],
                          {"id": "last", "deps": ["a"]}])
    assert _foreseen(store.claim(job_id, "a", "w:1", 60, foresee=2)) == ["last"]
