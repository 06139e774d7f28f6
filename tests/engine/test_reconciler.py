"""Recovery (`reconciler.Reconciler.reconcile`) in-process: lost messages and dead workers.

A lost message is one the stub drops from its queue (`broker.drop`); a dead worker is a lease
owner without a heartbeat (`cx:alive:<owner>` absent); time moves forward by moving the job's
recorded times back (the `q|<id>` timing of a queued action, a lease's expiry, the job's
`created_at`/`progress_at`), so each pass is judged with the shipped settings.
"""

from __future__ import annotations

import time

from cortex_worker.actions import dispatch, executor
from cortex_worker.jobs import lifecycle as jobs
from cortex_worker.jobs.options import JobOptions
from cortex_worker.llm.config import ModelConfig
from cortex_worker.recovery.owners import owner
from cortex_worker.recovery.reconciler import Reconciler
from cortex_worker.settings import Settings, get_settings
from cortex_worker.store.keys import alive_key, job_keys, model_keys, wake_channel
from cortex_worker.store.state import Store
from cortex_worker.testing import CANVAS, StubBroker
from tests.engine.helpers import action, events, of, one, status
from tests.fake_llm import FakeLLM, Turn

READINESS = JobOptions(canvas=False)
GHOST = "ghost-host:4242"  # a worker of another host, which never beats: dead
DOC = (action("a", "echo", {"message": "A"})
       + action("b", "echo", {"message": "$a"}, depends_on=["a"]))


def redriven(store: Store, job_id: str) -> list[dict[str, object]]:
    return [e["data"] for e in of(events(store, job_id), "warning")
            if e["data"]["kind"] == "action_redriven"]


def sent_actions(broker: StubBroker, job_id: str) -> list[str]:
    return [m.args[1] for m in broker.messages(dispatch.ACTION_TASK) if m.args[0] == job_id]


def age_queued(store: Store, job_id: str, action_id: str, seconds: float) -> None:
    """Make the action look queued `seconds` ago."""
    store.redis.hset(job_keys(job_id).timings, f"q|{action_id}", repr(time.time() - seconds))


def test_a_queued_action_whose_message_was_lost_is_sent_again(store: Store,
                                                              broker: StubBroker) -> None:
    job_id = jobs.submit_document(store, DOC, options=READINESS)
    broker.step()  # the start sends `a`
    (lost,) = broker.drop(dispatch.ACTION_TASK)
    reconciler = Reconciler(store, get_settings())
    assert reconciler.reconcile() == 0  # queued just now: within the grace period (10 s)
    assert broker.messages() == []

    age_queued(store, job_id, "a", 60)
    assert reconciler.reconcile() == 1
    (again,) = broker.messages()
    assert (again.name, again.args[:2], again.task_id, again.queue) == (
        lost.name, lost.args[:2], lost.task_id, lost.queue)
    (warning,) = redriven(store, job_id)
    assert (warning["action_id"], warning["times"]) == ("a", 1)
    assert "no worker took it (its message was lost); it was sent again" in warning["message"]
    assert reconciler.reconcile() == 0  # queued again just now, and the grace doubled

    broker.join()
    assert status(store, job_id) == "completed"
    log = events(store, job_id)
    assert one(log, "action_started", "a") and one(log, "action_completed", "b")
    assert store.active_jobs() == []


def test_a_queued_action_still_in_its_queue_only_waits(store: Store,
                                                        broker: StubBroker) -> None:
    """Queued long ago behind other work, but its message is still in the broker: it is not
    lost, so nothing is sent again and no warning says so (a flood of queued work was filling
    the logs with false "lost" warnings and its lanes with duplicates)."""
    job_id = jobs.submit_document(store, DOC, options=READINESS)
    broker.step()  # the start sends `a`, which waits in its queue
    age_queued(store, job_id, "a", 600)
    reconciler = Reconciler(store, get_settings())
    assert reconciler.reconcile() == 0
    assert len(sent_actions(broker, job_id)) == 1 and redriven(store, job_id) == []
    broker.drop(dispatch.ACTION_TASK)  # now it is lost
    assert reconciler.reconcile() == 1
    assert [w["action_id"] for w in redriven(store, job_id)] == ["a"]
    broker.join()
    assert status(store, job_id) == "completed"


def test_a_queued_action_is_sent_again_with_the_grace_doubling(store: Store,
                                                               broker: StubBroker) -> None:
    job_id = jobs.submit_document(store, DOC, options=READINESS)
    broker.step()
    reconciler = Reconciler(store, get_settings())
    for times in (1, 2):
        broker.drop(dispatch.ACTION_TASK)
        age_queued(store, job_id, "a", 10 * 2 ** (times - 1) - 1)
        assert reconciler.reconcile() == 0  # not yet: 10 s, then 20 s
        age_queued(store, job_id, "a", 10 * 2 ** (times - 1) + 1)
        assert reconciler.reconcile() == 1
        assert sent_actions(broker, job_id) == ["a"]
    assert [w["times"] for w in redriven(store, job_id)] == [1, 2]
    broker.join()
    assert status(store, job_id) == "completed"


def test_a_running_action_of_a_live_worker_is_left_alone(store: Store,
                                                         broker: StubBroker) -> None:
    job_id = jobs.submit_document(store, DOC, options=READINESS)
    broker.step()
    broker.drop(dispatch.ACTION_TASK)  # a worker took it ...
    assert store.claim(job_id, "a", GHOST, 60.0)[0] == "run"  # ... and runs it
    store.beat(GHOST, 10.0)  # it beats
    age_queued(store, job_id, "a", 3600)
    assert Reconciler(store, get_settings()).reconcile() == 0
    assert store.action_status(job_id, "a") == "running" and broker.messages() == []


def test_a_running_action_whose_worker_died_is_sent_again_then_fails(
        store: Store, broker: StubBroker) -> None:
    job_id = jobs.submit_document(store, DOC, options=READINESS)
    broker.step()
    reconciler = Reconciler(store, Settings(max_redrives=1))

    broker.drop(dispatch.ACTION_TASK)  # a worker took `a` ...
    assert store.claim(job_id, "a", GHOST, 60.0)[0] == "run"
    store.beat(GHOST, 10.0)
    assert reconciler.reconcile() == 0
    store.redis.delete(alive_key(GHOST))  # ... and died
    assert reconciler.reconcile() == 1
    assert sent_actions(broker, job_id) == ["a"]
    assert store.action_status(job_id, "a") == "queued"
    (warning,) = redriven(store, job_id)
    assert (warning["action_id"], warning["times"]) == ("a", 1)
    assert warning["message"] == f"action 'a': its worker {GHOST} stopped; it was sent again"

    broker.drop(dispatch.ACTION_TASK)  # taken by a worker that dies too: past max_redrives
    assert store.claim(job_id, "a", GHOST, 60.0)[0] == "run"
    assert reconciler.reconcile() == 0
    assert broker.messages() == []  # `b` was skipped: nothing to send
    log = events(store, job_id)
    error = one(log, "action_failed", "a")["error"]
    assert error.startswith("lost ") and error.endswith(
        f"time(s): its worker {GHOST} stopped each time (max_redrives is 1)")
    assert one(log, "action_skipped", "b")["reason"] == "dependency a did not succeed"
    assert status(store, job_id) == "failed"
    assert log[-1]["type"] == "job_failed"
    assert store.active_jobs() == []
    assert reconciler.reconcile() == 0


def test_giving_up_counts_every_loss(store: Store, broker: StubBroker) -> None:
    job_id = jobs.submit_document(store, DOC, options=READINESS)
    broker.step()
    reconciler = Reconciler(store, Settings(max_redrives=1))
    for _ in range(2):  # lost twice: sent again once, then it fails
        broker.drop(dispatch.ACTION_TASK)
        assert store.claim(job_id, "a", GHOST, 60.0)[0] == "run"
        reconciler.reconcile()
    error = one(events(store, job_id), "action_failed", "a")["error"]
    assert error == f"lost 2 time(s): its worker {GHOST} stopped each time (max_redrives is 1)"


def test_a_running_action_whose_lease_ran_out_is_sent_again(store: Store,
                                                            broker: StubBroker) -> None:
    job_id = jobs.submit_document(store, DOC, options=READINESS)
    broker.step()
    broker.drop(dispatch.ACTION_TASK)
    assert store.claim(job_id, "a", GHOST, 60.0)[0] == "run"
    store.beat(GHOST, 10.0)  # alive, but stuck: its lease ran out 60 s ago
    store.redis.hset(job_keys(job_id).lease, "a", f"{GHOST}|{time.time() - 60!r}")
    assert Reconciler(store, get_settings()).reconcile() == 1
    (warning,) = redriven(store, job_id)
    assert warning["message"] == (f"action 'a': its lease (held by {GHOST}) ran out; "
                                  "it was sent again")
    broker.join()
    assert status(store, job_id) == "completed"
    log = events(store, job_id)
    assert [(e["data"]["attempt"], e["data"]["worker"]) for e in of(log, "action_started", "a")] \
        == [(1, GHOST), (2, owner())]
    assert one(log, "action_completed", "a")["result"] == "A"


def test_a_job_whose_start_was_lost_is_started_again(store: Store, broker: StubBroker) -> None:
    job_id = jobs.submit_document(store, DOC, options=READINESS)
    (lost,) = broker.drop(dispatch.START_TASK)
    reconciler = Reconciler(store, get_settings())
    assert reconciler.reconcile() == 0  # just queued
    ago = time.time() - 60
    store.set_job(job_id, created_at=ago, progress_at=ago)
    assert reconciler.reconcile() == 1
    (again,) = broker.messages()
    assert (again.name, again.args, again.task_id) == (lost.name, lost.args, lost.task_id)
    (warning,) = [e["data"] for e in of(events(store, job_id), "warning")]
    assert warning["kind"] == "start_redriven"
    assert warning["message"].startswith("the document job had not started ")
    assert reconciler.reconcile() == 0  # the warning is progress: not due again yet
    broker.join()
    assert status(store, job_id) == "completed"
    assert one(events(store, job_id), "job_started")


def test_a_lost_canvas_goes_on_by_readiness_dispatch(store: Store, broker: StubBroker) -> None:
    doc = DOC + action("c", "echo", {"message": "$b"}, depends_on=["b"])
    job_id = jobs.submit_document(store, doc, options=JobOptions(canvas=True))
    broker.step()  # the start sends the canvas ...
    assert len(broker.drop(CANVAS)) == 1  # ... which is lost
    age_queued(store, job_id, "a", 60)
    assert Reconciler(store, get_settings()).reconcile() == 1
    assert [(m.name, m.args[1]) for m in broker.messages()] == [(dispatch.ACTION_TASK, "a")]
    broker.join()
    assert status(store, job_id) == "completed"
    assert [m.args[1] for m in broker.ran if m.name == dispatch.ACTION_TASK] == ["a", "b", "c"]
    assert [e["data"]["action_id"] for e in of(events(store, job_id), "action_started")] \
        == ["a", "b", "c"]


def test_a_job_left_finishing_is_finished(store: Store, broker: StubBroker) -> None:
    job_id = jobs.submit_document(store, action("a", "echo", {"message": 1}),
                                  options=READINESS)
    broker.step()
    broker.drop(dispatch.ACTION_TASK)
    # a worker runs `a`, records its end, and dies before it acts on the drained job
    assert store.claim(job_id, "a", GHOST, 60.0)[0] == "run"
    spec = store.spec(job_id, "a")
    assert spec is not None
    done = store.finish(job_id, "a", "ok", {"status": "ok", "value": 1}, 1, None,
                        ("action_completed", {"action_id": "a", "status": "ok", "result": 1}))
    assert done.recorded and done.drained
    assert status(store, job_id) == "finishing"
    reconciler = Reconciler(store, get_settings())
    assert reconciler.reconcile() == 0  # it just happened
    ago = time.time() - 60
    store.set_job(job_id, progress_at=ago)
    assert reconciler.reconcile() == 1
    assert status(store, job_id) == "completed"
    log = events(store, job_id)
    assert [e["data"]["kind"] for e in of(log, "warning")] == ["drain_redriven"]
    assert log[-1]["type"] == "job_completed"


def test_a_turn_whose_coordinator_died_is_sent_again_at_once(store: Store,
                                                              broker: StubBroker) -> None:
    """Its owner is known to be dead (no heartbeat): no grace period for the first resend;
    the next ones wait for the grace period, doubled each time, while nothing moves."""
    job_id = f"dead-turn-{time.time_ns()}"
    store.create_job(job_id, {"kind": "agent", "agent": "tester"}, ttl=600)
    assert store.resume(job_id, GHOST) is not None  # mid-turn: the plan is open
    reconciler = Reconciler(store, get_settings())
    assert reconciler.reconcile() == 1
    assert [(m.name, m.args) for m in broker.messages()] == [(dispatch.TURN_TASK, [job_id])]
    (warning,) = of(events(store, job_id), "warning")
    assert warning["data"]["kind"] == "turn_redriven" and GHOST in warning["data"]["message"]
    assert reconciler.reconcile() == 0  # sent just now: the message may still be on its way
    store.set_job(job_id, progress_at=time.time() - 15)
    assert reconciler.reconcile() == 0  # the second time waits twice the grace (20 s)
    store.set_job(job_id, progress_at=time.time() - 25)
    assert reconciler.reconcile() == 1


def test_a_drain_handed_to_a_waiting_turn_that_died_is_sent_again(store: Store,
                                                                   broker: StubBroker) -> None:
    """The process whose turn waited in place for the actions got the drain (it listened), then
    died before it took the next turn: the job is left `finishing`, and the reconciler sends the
    turn as it does any drain nobody acted on."""
    job_id = f"waited-{time.time_ns()}"
    store.create_job(job_id, {"kind": "agent", "agent": "tester"}, ttl=600)
    assert store.resume(job_id, GHOST) is not None
    registered = store.register(job_id, [{"id": "a", "spec": '{"id": "a", "type": "tool"}',
                                          "deps": [], "after": [], "on_error": "fail"}], close=False)
    assert [r["id"] for r in registered.ready] == ["a"]
    assert not store.end_turn(job_id, [], {}, waiter=GHOST)
    pubsub = store.redis.pubsub()  # the waiter's process, listening until it dies
    pubsub.subscribe(wake_channel(GHOST))
    try:
        assert pubsub.get_message(timeout=1)["type"] == "subscribe"
        done = store.finish(job_id, "a", "ok", {"status": "ok"}, 1, None,
                            ("action_completed", {"action_id": "a", "status": "ok", "result": 1}))
        assert done.recorded and not done.drained  # published to the waiter: nothing sent
    finally:
        pubsub.close()
    assert status(store, job_id) == "finishing" and broker.messages() == []
    reconciler = Reconciler(store, get_settings())
    assert reconciler.reconcile() == 0  # it just happened
    store.set_job(job_id, progress_at=time.time() - 60)
    assert reconciler.reconcile() == 1
    assert [(m.name, m.args) for m in broker.messages()] == [(dispatch.TURN_TASK, [job_id])]
    assert [e["data"]["kind"] for e in of(events(store, job_id), "warning")] == ["drain_redriven"]


def test_a_redelivery_waits_for_the_live_worker_that_runs_the_action(
        store: Store, broker: StubBroker) -> None:
    job_id = jobs.submit_document(store, DOC, options=READINESS)
    broker.step()
    (message,) = broker.messages(dispatch.ACTION_TASK)
    assert store.claim(job_id, "a", GHOST, 60.0)[0] == "run"  # another worker runs `a` ...
    store.beat(GHOST, 10.0)  # ... and lives
    assert broker.step() is message
    assert message.value == "busy"  # sent again to look once the lease may have run out
    (later,) = broker.messages(dispatch.ACTION_TASK)
    assert later.args[1] == "a" and later.countdown == 5.0
    spec = store.spec(job_id, "a")
    assert spec is not None  # the other worker ends `a` (and sends `b`)
    assert executor.record_outcome(store, job_id, "a", spec, "ok", "A", None) == "ok"
    broker.join()
    assert later.value == "done"
    assert status(store, job_id) == "completed"
    log = events(store, job_id)
    assert one(log, "action_started", "a")["worker"] == GHOST
    assert one(log, "action_completed", "b")["result"] == "A"


def test_a_redelivery_in_the_process_that_runs_the_action_waits_too(
        store: Store, broker: StubBroker) -> None:
    """Two deliveries of one action can reach one process (a message restored after a broker
    reconnect, one sent again while a thread still runs it): the lease is this process's, but
    another thread holds it, so the second is `busy` as it would be in another worker. It
    used to take the lease over and run the action a second time, beside the first."""
    job_id = jobs.submit_document(store, DOC, options=READINESS)
    broker.step()
    (message,) = broker.messages(dispatch.ACTION_TASK)
    assert store.claim(job_id, "a", owner(), 60.0)[0] == "run"  # a thread of this process
    store.beat(owner(), 10.0)  # which lives (a worker process beats)
    assert broker.step() is message
    assert message.value == "busy"
    (later,) = broker.messages(dispatch.ACTION_TASK)
    assert later.args[1] == "a" and later.countdown == 5.0
    spec = store.spec(job_id, "a")
    assert spec is not None
    assert executor.record_outcome(store, job_id, "a", spec, "ok", "A", None) == "ok"
    broker.join()
    assert later.value == "done"
    assert status(store, job_id) == "completed"
    log = events(store, job_id)
    assert [e["data"]["attempt"] for e in of(log, "action_started", "a")] == [1]
    assert len(of(log, "action_completed", "a")) == 1


def test_a_pass_reads_every_job_in_the_same_few_round_trips(store: Store, broker: StubBroker,
                                                             monkeypatch) -> None:
    """A pass runs every few seconds over every active job: with nothing to recover, it reads
    them in a fixed number of Redis round trips, however many jobs there are."""
    reconciler = Reconciler(store, get_settings())
    pool = store.redis.connection_pool
    taken = pool.get_connection

    def round_trips(n: int) -> int:
        for _ in range(n):
            jobs.submit_document(store, DOC, options=READINESS)
        broker.step()
        calls = 0

        def counted(*args: object, **kwargs: object) -> object:
            nonlocal calls
            calls += 1
            return taken(*args, **kwargs)

        monkeypatch.setattr(pool, "get_connection", counted)
        assert reconciler.reconcile() == 0
        monkeypatch.setattr(pool, "get_connection", taken)
        return calls

    assert round_trips(3) == round_trips(30) <= 4


def test_an_llm_action_held_while_its_endpoint_is_paused_is_not_lost(
        store: Store, broker: StubBroker, llm: FakeLLM) -> None:
    """An llm action held in its queue while its model endpoint is paused (its message comes
    back when the pause ends, with a countdown a real broker holds past the grace period, so
    `held` cannot vouch for it) is not sent again before then; it is once the pause has ended
    a grace period ago and the action is still not claimed."""
    llm.script("documents", [Turn(text="the answer")])
    doc = action("a", "summarise", {"text": "x"}).replace('type="tool"', 'type="llm"')
    job_id = jobs.submit_document(store, doc, options=READINESS)
    broker.step()  # the start sends `a`
    spec = store.spec(job_id, "a")
    assert spec is not None
    endpoint = ModelConfig.from_wire(spec["model"]).endpoint()
    store.model_answer(endpoint, refused=True, reset_s=120.0, remaining=None)
    broker.join(delayed=False)  # `a` waits: its task is sent again for the pause's end
    broker.drop(dispatch.ACTION_TASK)  # a broker that cannot say it holds the message
    age_queued(store, job_id, "a", 600)
    reconciler = Reconciler(store, get_settings())
    assert reconciler.reconcile() == 0 and redriven(store, job_id) == []

    store.redis.hdel(model_keys(endpoint).state, "pause_until")
    store.redis.hset(job_keys(job_id).timings, "m|a", repr(time.time() - 11))  # ended, + grace
    assert reconciler.reconcile() == 1
    assert [w["action_id"] for w in redriven(store, job_id)] == ["a"]
    broker.join()
    assert status(store, job_id) == "completed"
    assert [e["data"]["attempt"] for e in of(events(store, job_id), "action_started")] == [1]
