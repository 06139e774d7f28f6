"""Document jobs through the engine in-process: submit, `broker.join()`, then the job's state.

Each test drives the public job functions (`jobs.submit_document`, `jobs.cancel_job`) and the
Celery tasks as the stub runs them; assertions are on the event log, the variables and the
messages the engine sent (`broker.sent`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from celery.canvas import Signature

from cortex_worker.actions import dispatch
from cortex_worker.jobs import lifecycle as jobs
from cortex_worker.jobs.options import JobOptions
from cortex_worker.plan.canvas import STEP_RUN
from cortex_worker.protocol.document import load_document
from cortex_worker.protocol.events import ACTION_TERMINAL
from cortex_worker.store.state import Store
from cortex_worker.testing import CANVAS, StubBroker
from tests.engine.helpers import RoundTrips, action, events, of, one, status
from tests.fake_llm import FakeLLM, Turn
from tests.manifest_helpers import CORPUS

READINESS = JobOptions(canvas=False)
FAST = 5000.0  # tokens per second: a model's answer streams in a few milliseconds


def actions_run(broker: StubBroker, job_id: str) -> list[str]:
    """Ids of the action messages of `job_id` that ran, in order."""
    return [m.args[1] for m in broker.ran
            if m.name == dispatch.ACTION_TASK and m.args[0] == job_id]


def test_document_completes_with_its_events_and_variables(store: Store,
                                                           broker: StubBroker) -> None:
    doc = (action("a", "echo", {"message": "hi"})
           + action("b", "calculator", {"expression": "40 + 2"}, depends_on=["a"],
                    output_key="total")
           + action("c", "echo", {"message": "$a!"}, depends_on=["a"])
           + action("d", "echo", {"message": {"t": "$total", "c": "$c"}}, depends_on=["b", "c"])
           + "<response>total=$total c=$c</response>")
    job_id = jobs.submit_document(store, doc, options=READINESS)
    assert [(m.name, m.queue, m.task_id) for m in broker.messages()] == [
        (dispatch.START_TASK, "agent", f"{job_id}:start")]
    assert status(store, job_id) == "queued"

    assert broker.join() == 5
    assert status(store, job_id) == "completed"
    job = store.get_job(job_id)
    assert job is not None and job.dispatch == "readiness"
    assert job.result == "total=42 c=hi!"
    assert [(m.name, m.queue, m.task_id) for m in broker.sent[1:]] == [
        (dispatch.ACTION_TASK, "tool", f"{job_id}:{a}") for a in "abcd"]
    assert actions_run(broker, job_id) == ["a", "b", "c", "d"]

    log = events(store, job_id)
    kinds = [e["type"] for e in log]
    assert kinds[:2] == ["job_queued", "job_started"]
    assert kinds[-2:] == ["response_end", "job_completed"]
    for a in "abcd":
        assert one(log, "action_queued", a) and one(log, "action_started", a)
    assert one(log, "action_completed", "b")["result"] == 42
    assert one(log, "action_completed", "c")["result"] == "hi!"
    assert one(log, "action_completed", "d")["result"] == {"t": 42, "c": "hi!"}
    seq = {(e["type"], e["data"].get("action_id")): e["seq"] for e in log}
    for later, earlier in (("b", "a"), ("c", "a"), ("d", "b"), ("d", "c")):
        assert seq[("action_queued", later)] > seq[("action_completed", earlier)]
    assert one(log, "response_end")["text"] == "total=42 c=hi!"
    assert one(log, "job_completed")["status"] == "completed"
    assert store.variables(job_id, ["a", "b", "total", "c", "d"]) == {
        "a": "hi", "b": 42, "total": 42, "c": "hi!", "d": {"t": 42, "c": "hi!"}}
    assert store.action_statuses(job_id) == dict.fromkeys("abcd", "ok")
    assert store.active_jobs() == []


def test_a_failed_dependency_skips_its_dependents(store: Store, broker: StubBroker) -> None:
    doc = (action("bad", "fail", {"message": "boom"})
           + action("after", "echo", {"message": "$bad"}, depends_on=["bad"])
           + action("chained", "echo", {"message": "$after"}, depends_on=["after"])
           + action("rescue", "echo", {"message": "$bad"}, depends_on=["bad"],
                    on_error="continue")
           + action("free", "echo", {"message": "unrelated"}))
    job_id = jobs.submit_document(store, doc, options=READINESS)
    broker.join()
    assert status(store, job_id) == "failed"
    log = events(store, job_id)
    assert "boom" in one(log, "action_failed", "bad")["error"]
    assert one(log, "action_skipped", "after")["reason"] == "dependency bad did not succeed"
    assert one(log, "action_skipped", "chained")["reason"] == "dependency after did not succeed"
    rescued = one(log, "action_completed", "rescue")["result"]
    assert rescued["status"] == "error" and "boom" in rescued["error"]
    assert one(log, "action_completed", "free")["result"] == "unrelated"
    assert sorted(actions_run(broker, job_id)) == ["bad", "free", "rescue"]  # never the skipped
    assert store.action_statuses(job_id) == {
        "bad": "error", "after": "skipped", "chained": "skipped", "rescue": "ok", "free": "ok"}
    assert one(log, "job_failed")["error"] == "1 action(s) failed"


def test_fail_fast_fails_the_job_and_cancels_the_rest(store: Store, broker: StubBroker) -> None:
    doc = (action("bad", "fail", {"message": "nope"})
           + action("other", "echo", {"message": "x"})
           + action("after", "echo", {"message": "$other"}, depends_on=["other"]))
    job_id = jobs.submit_document(store, doc, options=JobOptions(fail_fast=True, canvas=False))
    broker.step()  # the start: `bad` and `other` are sent
    assert [m.args[1] for m in broker.messages(dispatch.ACTION_TASK)] == ["bad", "other"]
    broker.join()
    assert status(store, job_id) == "failed"
    assert actions_run(broker, job_id) == ["bad"]  # `other` was revoked while queued
    assert f"{job_id}:other" in broker.revoked
    assert [m.state for m in broker.messages(task_id=f"{job_id}:other", sent=True)] == ["revoked"]
    log = events(store, job_id)
    failed = one(log, "job_failed")
    assert failed["reason"].startswith("fail_fast: action 'bad' ended error: ")
    assert "nope" in failed["reason"]
    assert store.action_statuses(job_id) == {"bad": "error", "other": "cancelled",
                                             "after": "cancelled"}
    assert one(log, "action_cancelled", "other") and one(log, "action_cancelled", "after")
    assert of(log, "action_started", "other") == []
    assert log[-1]["type"] == "job_failed"


def test_max_parallel_parks_actions_and_releases_them(store: Store, broker: StubBroker) -> None:
    doc = "".join(action(f"n{i}", "echo", {"message": i}) for i in range(4))
    job_id = jobs.submit_document(store, doc, options=JobOptions(max_parallel=2))
    broker.step()  # the start
    assert store.get_job(job_id).dispatch == "readiness"  # type: ignore[union-attr]  # too wide for a canvas
    assert store.action_statuses(job_id) == {"n0": "queued", "n1": "queued",
                                             "n2": "waiting", "n3": "waiting"}
    assert [m.args[1] for m in broker.messages(dispatch.ACTION_TASK)] == ["n0", "n1"]
    most = 0
    while broker.step() is not None:
        statuses = store.action_statuses(job_id)
        busy = [a for a, s in statuses.items() if s in ("queued", "running")]
        most = max(most, len(busy))
        queued = {m.args[1] for m in broker.messages(dispatch.ACTION_TASK)}
        assert queued == set(busy)  # a released action was sent; a parked one was not
    assert most == 2
    assert status(store, job_id) == "completed"
    assert actions_run(broker, job_id) == ["n0", "n1", "n2", "n3"]
    log = events(store, job_id)
    seq = {(e["type"], e["data"].get("action_id")): e["seq"] for e in log}
    assert seq[("action_queued", "n2")] > seq[("action_completed", "n0")]
    assert seq[("action_queued", "n3")] > seq[("action_completed", "n1")]


def test_cancel_mid_plan_runs_nothing_more(store: Store, broker: StubBroker) -> None:
    doc = (action("first", "echo", {"message": 1})
           + action("second", "echo", {"message": "$first"}, depends_on=["first"])
           + action("third", "echo", {"message": "$second"}, depends_on=["second"])
           + action("side", "echo", {"message": "$first"}, depends_on=["first"]))
    job_id = jobs.submit_document(store, doc, options=READINESS)
    broker.step()  # the start
    broker.step()  # `first`: it sends `second` and `side`
    assert store.action_status(job_id, "first") == "ok"
    assert {m.args[1] for m in broker.messages(dispatch.ACTION_TASK)} == {"second", "side"}

    assert jobs.cancel_job(store, job_id) is True
    assert jobs.cancel_job(store, job_id) is False  # once
    assert broker.messages() == []  # the queued actions were revoked
    assert set(broker.revoked) == {f"{job_id}:second", f"{job_id}:side"}
    broker.join()
    assert actions_run(broker, job_id) == ["first"]
    assert status(store, job_id) == "cancelled"
    assert store.action_statuses(job_id) == {"first": "ok", "second": "cancelled",
                                             "third": "cancelled", "side": "cancelled"}
    log = events(store, job_id)
    for a in ("first", "second", "third", "side"):  # every action ends once
        assert len([e for e in log if e["data"].get("action_id") == a
                    and e["type"] in ("action_completed", "action_failed", "action_skipped",
                                      "action_cancelled")]) == 1
    assert one(log, "job_cancelled")["reason"] == "cancelled by request"
    assert log[-1]["type"] == "job_cancelled"
    results = store.results(job_id, ["first", "second", "third", "side"])
    assert len(results) == 4 and all(r["status"] in ACTION_TERMINAL for r in results.values())


def test_cancelled_job_ignores_a_message_that_was_already_taken(store: Store,
                                                                 broker: StubBroker) -> None:
    doc = action("first", "echo", {"message": 1}) + action("second", "echo", {"message": 2})
    job_id = jobs.submit_document(store, doc, options=READINESS)
    broker.step()  # the start
    broker.step()  # `first`
    (taken,) = broker.drop(task_id=f"{job_id}:second")  # a worker took it before the cancel
    jobs.cancel_job(store, job_id)
    late = broker.send_task(taken.name, taken.args, queue=taken.queue, task_id=taken.task_id)
    broker.join()
    assert late.get() == "stop"  # it runs after the cancel: nothing is started
    log = events(store, job_id)
    assert of(log, "action_started", "second") == []
    assert store.action_statuses(job_id) == {"first": "ok", "second": "cancelled"}
    assert log[-1]["type"] == "job_cancelled"


def test_a_canvas_plan_completes_through_the_stub(store: Store, broker: StubBroker) -> None:
    doc = (action("a", "echo", {"message": 1})
           + action("b", "calculator", {"expression": "$a + 1"}, depends_on=["a"])
           + action("c", "calculator", {"expression": "$a + 2"}, depends_on=["a"])
           + action("d", "echo", {"message": ["$b", "$c"]}, depends_on=["b", "c"])
           + action("e", "calculator", {"expression": "${d.0} * 10"}, depends_on=["d"])
           + "<response>$e</response>")
    job_id = jobs.submit_document(store, doc, options=JobOptions(canvas=True))
    broker.join()
    assert status(store, job_id) == "completed"
    assert store.get_job(job_id).dispatch == "canvas"  # type: ignore[union-attr]
    canvases = [m for m in broker.sent if m.name == CANVAS]
    assert len(canvases) == 1 and canvases[0].queue == "tool"
    assert [m.name for m in broker.sent] == [dispatch.START_TASK, CANVAS]  # no action message
    log = events(store, job_id)
    assert [e["data"]["action_id"] for e in of(log, "action_started")] == list("abcde")
    assert one(log, "action_completed", "d")["result"] == [2, 3]
    assert one(log, "action_completed", "e")["result"] == 20
    assert store.get_job(job_id).result == "20"  # type: ignore[union-attr]


def test_a_canvas_chain_travels_as_its_first_step_and_the_ids_of_the_rest(
        store: Store, broker: StubBroker, monkeypatch: pytest.MonkeyPatch) -> None:
    """The canvas a job sends, as Celery would publish it: its first step's message carries
    the later steps as runs of ids, in its job's lane and at its priority."""
    doc = "".join(action(f"s{i}", "echo", {"message": i},
                         depends_on=[f"s{i - 1}"] if i else None) for i in range(4))
    job_id = jobs.submit_document(store, doc, options=JobOptions(canvas=True, priority=3))
    broker.step()  # the start sends the canvas
    canvas = next(m for m in broker.sent if m.name == CANVAS).signature
    published: list[tuple[Any, dict[str, Any]]] = []
    monkeypatch.setattr(Signature, "_apply_async", property(
        lambda self: lambda *args, **options: published.append((self, options))))
    canvas.apply_async()
    [(first, options)] = published
    route = dispatch.route_of(job_id, {"id": "s0", "type": "tool", "name": "echo"})
    assert route["priority"] == 3
    assert first.args == (job_id, "s0") and first.options["queue"] == route["queue"]
    assert options["chain"] == [{"subtask_type": STEP_RUN, "task": dispatch.ACTION_TASK,
                                 "job": job_id, "ids": ["s1", "s2", "s3"],
                                 "queue": route["queue"], "priority": 3}]


def test_a_failure_in_a_canvas_skips_the_rest_of_its_chain(store: Store,
                                                           broker: StubBroker) -> None:
    doc = (action("a", "echo", {"message": 1})
           + action("bad", "fail", {"message": "in the chain"}, depends_on=["a"])
           + action("after", "echo", {"message": "$bad"}, depends_on=["bad"]))
    job_id = jobs.submit_document(store, doc, options=JobOptions(canvas=True))
    broker.join()
    assert store.get_job(job_id).dispatch == "canvas"  # type: ignore[union-attr]
    assert status(store, job_id) == "failed"
    log = events(store, job_id)
    assert one(log, "action_skipped", "after")["reason"] == "dependency bad did not succeed"
    assert of(log, "action_started", "after") == []
    assert store.action_statuses(job_id) == {"a": "ok", "bad": "error", "after": "skipped"}


def test_a_redelivered_action_is_recorded_once(store: Store, broker: StubBroker) -> None:
    doc = (action("a", "echo", {"message": "once"})
           + action("b", "echo", {"message": "$a"}, depends_on=["a"]))
    job_id = jobs.submit_document(store, doc, options=READINESS)
    broker.step()  # the start sends `a`
    (sent,) = broker.messages(dispatch.ACTION_TASK)
    again = broker.send_task(sent.name, sent.args, queue=sent.queue, task_id=sent.task_id)
    broker.step()
    assert broker.step() is again.message
    assert again.get() == "done"  # its result was recorded: it did not run again
    broker.join()
    assert status(store, job_id) == "completed"
    assert actions_run(broker, job_id) == ["a", "a", "b", "b"]  # the duplicate re-sent `b`
    log = events(store, job_id)
    for a in "ab":
        assert one(log, "action_started", a)["attempt"] == 1
        assert one(log, "action_completed", a)
    assert one(log, "job_completed")
    result = store.results(job_id, ["a"])["a"]
    assert (result["status"], result["value"], result["attempt"]) == ("ok", "once", 1)


def test_a_start_delivered_twice_starts_the_job_once(store: Store, broker: StubBroker) -> None:
    job_id = jobs.submit_document(store, action("a", "echo", {"message": 1}),
                                  options=READINESS)
    dispatch.start_job(job_id)  # as a redelivery would
    broker.join()
    log = events(store, job_id)
    assert one(log, "job_started") and one(log, "action_started", "a")
    assert one(log, "job_completed")


def test_invoke_runs_its_target_and_returns_the_value(store: Store, broker: StubBroker) -> None:
    spec = {"id": "feed", "type": "tool", "name": "calculator",
            "parameters": {"expression": "6 * 7"}}
    assert dispatch.invoke(spec, timeout=5, job_id="j") == 42
    assert [(m.name, m.queue, m.state) for m in broker.sent] == [
        (dispatch.INVOKE_TASK, "tool", "done")]


def test_a_cancel_before_the_start_runs_nothing(store: Store, broker: StubBroker) -> None:
    job_id = jobs.submit_document(store, action("a", "echo", {"message": 1}))
    assert jobs.cancel_job(store, job_id) is True
    broker.join()  # the start still comes: it finds the job ended
    assert [(m.name, m.state) for m in broker.ran] == [(dispatch.START_TASK, "done")]
    log = events(store, job_id)
    assert [e["type"] for e in log] == ["job_queued", "job_cancelled"]
    assert store.action_statuses(job_id) == {}


def test_a_cancel_before_the_canvas_runs_starts_nothing(store: Store,
                                                        broker: StubBroker) -> None:
    doc = (action("a", "echo", {"message": 1})
           + action("b", "echo", {"message": "$a"}, depends_on=["a"]))
    job_id = jobs.submit_document(store, doc, options=JobOptions(canvas=True))
    broker.step()  # the start sends the canvas
    assert [m.name for m in broker.messages()] == [CANVAS]
    jobs.cancel_job(store, job_id)
    broker.join()  # the canvas runs all the same: each step finds its job ended
    log = events(store, job_id)
    assert of(log, "action_started") == []
    assert store.action_statuses(job_id) == {"a": "cancelled", "b": "cancelled"}
    assert log[-1]["type"] == "job_cancelled"


def test_fail_fast_in_a_canvas_stops_the_other_steps(store: Store, broker: StubBroker) -> None:
    doc = (action("bad", "fail", {"message": "first"})
           + action("other", "echo", {"message": 1})
           + action("last", "echo", {"message": "$other"}, depends_on=["bad", "other"]))
    job_id = jobs.submit_document(store, doc, options=JobOptions(canvas=True, fail_fast=True))
    broker.join()
    assert store.get_job(job_id).dispatch == "canvas"  # type: ignore[union-attr]
    assert status(store, job_id) == "failed"
    log = events(store, job_id)
    assert [e["data"]["action_id"] for e in of(log, "action_started")] == ["bad"]
    assert store.action_statuses(job_id) == {"bad": "error", "other": "cancelled",
                                             "last": "cancelled"}
    assert log[-1]["type"] == "job_failed"


def test_a_failed_attempt_is_retried(store: Store, broker: StubBroker) -> None:
    doc = action("f", "flaky", {"key": "k", "failures": 1}, retry=1)
    job_id = jobs.submit_document(store, doc, options=READINESS)
    broker.join()
    assert status(store, job_id) == "completed"
    assert actions_run(broker, job_id) == ["f"]  # retried within its task
    log = events(store, job_id)
    assert [e["data"]["attempt"] for e in of(log, "action_started", "f")] == [1, 2]
    assert one(log, "action_retrying", "f")["attempt"] == 1
    assert one(log, "action_completed", "f")["result"] == {"key": "k", "attempts": 2}


def test_a_skip_frees_the_slots_of_parked_actions(store: Store, broker: StubBroker) -> None:
    doc = (action("bad", "fail", {"message": "x"})
           + action("after", "echo", {"message": "$bad"}, depends_on=["bad"])
           + action("free1", "echo", {"message": 1})
           + action("free2", "echo", {"message": 2}))
    job_id = jobs.submit_document(store, doc, options=JobOptions(max_parallel=1))
    broker.join()
    assert store.action_statuses(job_id) == {"bad": "error", "after": "skipped",
                                             "free1": "ok", "free2": "ok"}
    assert actions_run(broker, job_id) == ["bad", "free1", "free2"]
    assert status(store, job_id) == "failed"
    job = store.get_job(job_id)
    assert job is not None and job.running == 0


def test_a_job_and_its_first_events_are_created_in_one_round_trip(
        store: Store, broker: StubBroker, monkeypatch: pytest.MonkeyPatch) -> None:
    """The record, its indexes and `job_queued` go to Redis in one transaction: a submission
    is one round trip before its first step is sent (it took two)."""
    trips = RoundTrips(store, monkeypatch)
    trips.start_at(store, "create_job")
    at_send = trips.seen_at(dispatch, "start_job")
    for _ in range(2):  # the first also loads the emit script into Redis, once
        job_id = jobs.submit_document(store, action("a", "echo", {"message": "hi"}))
    assert at_send[-1] == 1
    assert [e["type"] for e in events(store, job_id)] == ["job_queued"]


def test_a_job_created_after_redis_lost_its_scripts_logs_its_events_once(
        store: Store, broker: StubBroker) -> None:
    """After a Redis restart the scripts are gone: the transaction creates the job, its
    `emit` fails alone (NOSCRIPT), and the events are logged the usual way, once."""
    store.redis.script_flush()
    job_id = jobs.submit_document(store, action("a", "echo", {"message": "hi"}))
    assert [e["type"] for e in events(store, job_id)] == ["job_queued"]
    assert status(store, job_id) == "queued"
    broker.join()
    assert status(store, job_id) == "completed"


# ---------------------------------------------------------------- moved from tests/integration

#: Corpus documents written for an agent whose manifest declares the feed `system_metrics`:
#: submitted as a document it has no such feed, and updating it fails with a precise error.
FAILS_AS_A_DOCUMENT = {
    "mk1_05_internal_actions": (
        "update_metrics_feed", "no context feed 'system_metrics'; add it with add_context_feed"),
}


@pytest.mark.parametrize("path", sorted(CORPUS.glob("*.xml")), ids=lambda p: p.stem)
def test_corpus_documents_run(store: Store, broker: StubBroker, llm: FakeLLM,
                              path: Path) -> None:
    text = path.read_text()
    for spec in load_document(text).actions:  # the agents it calls answer from the fake model
        if spec.type.value == "agent":
            llm.script(spec.name, [Turn(
                text=f'<response final="true">{spec.name} looked at it</response>',
                tokens_per_second=FAST)])
        if spec.type.value == "llm":  # CORTEX_DOCUMENT_MODEL: model "documents"
            llm.script("documents", [Turn(text="the model's answer", tokens_per_second=FAST)])
    job_id = jobs.submit_document(store, text)
    broker.join()
    log = events(store, job_id)  # numbered 1, 2, 3 ... without a gap
    failed_feeds = [w["data"] for w in of(log, "warning") if w["data"]["kind"] == "feed_failed"]
    assert failed_feeds == []
    if path.stem in FAILS_AS_A_DOCUMENT:
        action_id, error = FAILS_AS_A_DOCUMENT[path.stem]
        assert log[-1]["type"] == "job_failed", log[-1]
        assert one(log, "action_failed", action_id)["error"] == error
        return
    assert log[-1]["type"] == "job_completed", (
        log[-1], [e["data"] for e in log if e["type"] in ("action_failed", "warning")])
    for spec in load_document(text).actions:
        if spec.type.value == "agent":  # the child's final response is the action's value
            assert one(log, "action_completed", spec.id)["result"] == f"{spec.name} looked at it"
        if spec.type.value == "llm":
            assert one(log, "action_completed", spec.id)["result"] == "the model's answer"
    assert llm.remaining("documents") == 0


def test_tools_document_renders_its_response(store: Store, broker: StubBroker) -> None:
    doc = (action("search", "web_scraper", {"url": "https://example.com"})
           + action("calc", "calculator", {"expression": "42 + 8"}, mode="sync",
                    depends_on=["search"], output_key="total")
           + "<response>The total is $total; the page was ${search.url}.</response>")
    job_id = jobs.submit_document(store, doc)
    broker.join()
    log = events(store, job_id)
    assert one(log, "action_completed", "calc")["result"] == 50
    assert one(log, "response_end")["text"] == \
        "The total is 50; the page was https://example.com."
    assert log[-1]["type"] == "job_completed"
    assert status(store, job_id) == "completed"


def test_n_shape_starts_c_before_b_completes(store: Store, broker: StubBroker) -> None:
    """C depends on A only, D on A and B: once A ends C is sent, while B still runs (waves
    would hold C for B); D is sent only when both have ended."""
    doc = (action("A", "echo", {"message": "a"}) + action("B", "echo", {"message": "b"})
           + action("C", "echo", {"message": "c"}, depends_on=["A"])
           + action("D", "echo", {"message": "d"}, depends_on=["A", "B"]))
    job_id = jobs.submit_document(store, doc, options=READINESS)
    broker.step()  # the start sends A and B
    queued = {m.args[1]: m for m in broker.messages(dispatch.ACTION_TASK)}
    assert set(queued) == {"A", "B"}
    broker.run(queued["A"])  # A ends first: C is sent, D still waits for B
    sent = {m.args[1]: m for m in broker.messages(dispatch.ACTION_TASK)}
    assert set(sent) == {"B", "C"}
    broker.run(sent["C"])  # C runs before B has ended
    broker.join()
    log = events(store, job_id)
    assert log[-1]["type"] == "job_completed"
    seq = {(e["type"], e["data"].get("action_id")): e["seq"] for e in log}
    assert seq[("action_started", "C")] < seq[("action_completed", "B")]
    assert seq[("action_started", "D")] > seq[("action_completed", "B")]
    assert seq[("action_started", "D")] > seq[("action_completed", "A")]


def test_failure_skips_dependents_unless_continue(store: Store, broker: StubBroker) -> None:
    """A reference to a variable is a dependency too (`chained` and `rescue` name none)."""
    doc = (action("bad", "fail", {"message": "boom"})
           + action("after", "echo", {"message": "$bad"}, depends_on=["bad"])
           + action("chained", "echo", {"message": "$after"})
           + action("rescue", "echo", {"message": "$bad"}, on_error="continue"))
    job_id = jobs.submit_document(store, doc)
    broker.join()
    log = events(store, job_id)
    assert "boom" in one(log, "action_failed", "bad")["error"]
    assert one(log, "action_skipped", "after")["reason"] == "dependency bad did not succeed"
    assert one(log, "action_skipped", "chained")
    rescued = one(log, "action_completed", "rescue")["result"]
    assert rescued["status"] == "error" and "boom" in rescued["error"]
    assert log[-1]["type"] == "job_failed"


def test_retry_until_success(store: Store, broker: StubBroker) -> None:
    job_id = jobs.submit_document(store, action("f", "flaky", {"key": "k1", "failures": 2},
                                                retry=2))
    broker.join()
    log = events(store, job_id)
    assert len(of(log, "action_retrying", "f")) == 2
    assert [e["data"]["attempt"] for e in of(log, "action_started", "f")] == [1, 2, 3]
    assert one(log, "action_completed", "f")
    assert log[-1]["type"] == "job_completed"


def test_canvas_and_readiness_give_the_same_results(store: Store, broker: StubBroker) -> None:
    doc = (action("a", "echo", {"message": 1})
           + action("b", "calculator", {"expression": "2*3"}, depends_on=["a"])
           + action("c", "echo", {"message": "$a"})
           + action("d", "echo", {"message": ["$b", "$c"]}))
    results = {}
    for canvas in (True, False):
        job_id = jobs.submit_document(store, doc, options=JobOptions(canvas=canvas))
        broker.join()
        log = events(store, job_id)
        assert log[-1]["type"] == "job_completed"
        job = store.get_job(job_id)
        assert job is not None and job.dispatch == ("canvas" if canvas else "readiness")
        results[canvas] = (
            {e["data"]["action_id"]: e["data"]["result"] for e in of(log, "action_completed")},
            sorted(e["type"] for e in log),
        )
    assert results[True][0] == results[False][0] == {"a": 1, "b": 6, "c": 1, "d": [6, 1]}
    assert results[True][1] == results[False][1]

