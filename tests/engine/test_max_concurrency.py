"""`max_concurrency` slots against deliveries of one action (in-process engine, real Redis)."""

from __future__ import annotations

import pytest

from cortex_worker.actions import dispatch
from cortex_worker.jobs import lifecycle
from cortex_worker.jobs.options import JobOptions
from cortex_worker.store.state import Store
from cortex_worker.testing import StubBroker
from tests.engine.helpers import action, events, of, one, status

pytestmark = pytest.mark.engine

LIMIT = 2  # tests/manifests/tools.yaml: rate_limited


def test_a_second_delivery_leaves_the_slot_of_the_one_that_runs_the_action(
        store: Store, broker: StubBroker) -> None:
    """A redelivered action task finds its action held by a live delivery: it must not give
    back the slot that delivery runs in, or one more call than the limit would start (the
    fan-out of 500 in tests/integration/test_max_concurrency.py saw 4 at once under load)."""
    job_id = lifecycle.submit_document(store, action("r0", "rate_limited", {"seconds": 0}),
                                  options=JobOptions(canvas=False))
    while not broker.messages(dispatch.ACTION_TASK):
        assert broker.step() is not None, "the action was never sent"
    holder, owner = f"{job_id}:r0", "elsewhere:1"
    store.beat(owner, 60)  # the first delivery's process is alive
    assert store.take_slot("tool:rate_limited", holder, LIMIT, 60, None)
    assert store.claim(job_id, "r0", owner, 60, [])[0] == "run"

    (second,) = broker.messages(dispatch.ACTION_TASK)
    broker.run(second)

    assert store.slots_in_use("tool:rate_limited") == 1  # still the first delivery's
    assert status(store, job_id) == "running"
    store.give_slot("tool:rate_limited", holder, LIMIT)


def test_calls_past_the_limit_wait_without_a_message_and_each_runs_once(
        store: Store, broker: StubBroker) -> None:
    """Every slot is held by calls elsewhere: each call's delivery returns at once, leaving
    a place in line and no message (no worker slot waits); when a slot frees, the calls in
    line are sent one by one through it, never more at once than the limit."""
    elsewhere = [f"elsewhere:{i}" for i in range(LIMIT)]
    for holder in elsewhere:
        assert store.take_slot("tool:rate_limited", holder, LIMIT, 60, None)
    doc = "".join(action(f"r{i}", "rate_limited", {"seconds": 0}) for i in range(4))
    job_id = lifecycle.submit_document(store, doc,
                                       options=JobOptions(canvas=False, max_parallel=100))
    broker.join()
    calls = [m for m in broker.ran if m.name == dispatch.ACTION_TASK]
    assert [(m.args[1], m.value) for m in calls] == [(f"r{i}", "throttled") for i in range(4)]
    assert broker.messages() == []
    assert of(events(store, job_id), "action_started") == []
    assert status(store, job_id) == "running"

    # one call elsewhere ends and gives its slot back: the first call in line is sent
    (first,) = store.give_slot("tool:rate_limited", elsewhere[0], LIMIT)
    dispatch.send(first["job_id"], [first["spec"]])
    while broker.step() is not None:
        assert store.slots_in_use("tool:rate_limited") <= LIMIT
    assert status(store, job_id) == "completed"
    log = events(store, job_id)
    for i in range(4):  # each ran once, in the order it was in line
        assert one(log, "action_started", f"r{i}")["attempt"] == 1
        assert one(log, "action_completed", f"r{i}")
    assert [e["data"]["action_id"] for e in of(log, "action_started")] == [
        f"r{i}" for i in range(4)]
    assert store.slots_in_use("tool:rate_limited") == 1  # the one still held elsewhere
    assert store.give_slot("tool:rate_limited", elsewhere[1], LIMIT) == []
