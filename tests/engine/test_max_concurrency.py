"""`max_concurrency` slots against deliveries of one action (in-process engine, real Redis)."""

from __future__ import annotations

import pytest

from cortex_worker.actions import dispatch
from cortex_worker.jobs import lifecycle
from cortex_worker.jobs.options import JobOptions
from cortex_worker.store.state import Store
from cortex_worker.testing import StubBroker
from tests.engine.helpers import action, status

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
    assert store.take_slot("rate_limited", holder, LIMIT, 60, None)
    assert store.claim(job_id, "r0", owner, 60, [])[0] == "run"

    (second,) = broker.messages(dispatch.ACTION_TASK)
    broker.run(second)

    assert store.slots_in_use("rate_limited") == 1  # still the first delivery's
    assert status(store, job_id) == "running"
    store.give_slot("rate_limited", holder, LIMIT)
