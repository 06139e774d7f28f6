"""A request sent again with its idempotency key finds the job the first one made
(`jobs.lifecycle.Once`): in the engine, with the real store, whatever the order of copies.
(A tool call's own idempotency key is tests/engine/test_idempotency.py's.)"""

from __future__ import annotations

import threading

import pytest

from cortex_worker.errors import AlreadySubmitted, SubmitError
from cortex_worker.jobs import lifecycle as jobs
from cortex_worker.jobs.lifecycle import Once
from cortex_worker.store.state import Store
from cortex_worker.testing import StubBroker
from tests.engine.helpers import action, events, of, status

DOC = action("a", "echo", {"message": "once"}) + "<response>$a</response>"


def test_a_copy_finds_the_job_and_makes_nothing(store: Store, broker: StubBroker) -> None:
    once = Once.of("key-1", {"protocol": DOC})
    job_id = jobs.submit_document(store, DOC, once=once, tenant="acme")
    broker.join()
    with pytest.raises(AlreadySubmitted) as copy:
        jobs.submit_document(store, DOC, once=Once.of("key-1", {"protocol": DOC}), tenant="acme")
    assert copy.value.job_id == job_id
    broker.join()
    assert status(store, job_id) == "completed"
    log = events(store, job_id)
    assert len(of(log, "job_queued")) == 1 and len(of(log, "action_started", "a")) == 1
    assert [m.args[0] for m in broker.ran if m.name == "cortex.start_job"] == [job_id]


def test_the_same_key_for_another_request_is_refused(store: Store, broker: StubBroker) -> None:
    job_id = jobs.submit_document(store, DOC, once=Once.of("key-2", {"protocol": DOC}))
    other = DOC.replace("once", "twice")
    with pytest.raises(SubmitError) as refused:
        jobs.submit_document(store, other, once=Once.of("key-2", {"protocol": other}))
    assert refused.value.errors[0]["kind"] == "idempotency_key_reused"
    assert job_id in refused.value.message


def test_keys_belong_to_their_tenant(store: Store, broker: StubBroker) -> None:
    once = Once.of("one-key", {"protocol": DOC})
    mine = jobs.submit_document(store, DOC, once=once, tenant="acme")
    theirs = jobs.submit_document(store, DOC, once=once, tenant="globex")
    assert mine != theirs
    assert store.peek(mine, "tenant").tenant == "acme"  # type: ignore[union-attr]
    assert store.peek(theirs, "tenant").tenant == "globex"  # type: ignore[union-attr]


def test_copies_sent_at_once_make_one_job(store: Store, broker: StubBroker) -> None:
    """Copies race to create the job in one transaction (WATCH on its record): one makes it,
    every other finds it."""
    once = Once.of("raced", {"protocol": DOC})
    made: list[str] = []
    found: list[str] = []
    start = threading.Barrier(8)

    def send() -> None:
        start.wait()
        try:
            made.append(jobs.submit_document(store, DOC, once=once))
        except AlreadySubmitted as exc:
            found.append(exc.job_id)

    threads = [threading.Thread(target=send) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 1 and len(found) == 7 and set(found) == set(made)
    broker.join()
    assert status(store, made[0]) == "completed"
    assert len(of(events(store, made[0]), "job_queued")) == 1


def test_a_copy_of_a_request_that_stopped_before_the_start_sends_it(
        store: Store, broker: StubBroker) -> None:
    """The first request made the job and stopped before it sent the start (its API process
    died): a copy finds the job still queued and sends the start, once more."""
    once = Once.of("stopped", {"protocol": DOC})
    job_id = jobs.submit_document(store, DOC, once=once)
    broker.pending.clear()  # the start never went out
    with pytest.raises(AlreadySubmitted):
        jobs.submit_document(store, DOC, once=once)
    broker.join()
    assert status(store, job_id) == "completed"
