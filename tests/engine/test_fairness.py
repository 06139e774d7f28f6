"""Fair by tenant, in-process: each tenant's messages go to its own lane of every pool's
queue (cortex_worker.actions.fairness, lua/tenant_lane.lua). That a worker takes from the lanes
in turn is kombu's (tests/integration/test_fairness.py shows it with real workers)."""

from __future__ import annotations

import uuid

from cortex_worker.actions import dispatch
from cortex_worker.jobs import lifecycle as jobs
from cortex_worker.jobs.options import JobOptions
from cortex_worker.pools import LANES, lanes
from cortex_worker.store.state import Store
from cortex_worker.testing import StubBroker
from tests.engine.helpers import status

DOC = '<action type="tool" mode="async" id="a">{"name": "echo", "parameters": {"text": "x"}}</action>'


def test_tenants_get_lanes_of_their_own_until_there_are_more_tenants_than_lanes(
        store: Store) -> None:
    tenants = [f"t{i}-{uuid.uuid4().hex[:6]}" for i in range(2 * LANES)]
    given = [store.tenant_lane(t, LANES) for t in tenants]
    assert sorted(given[:LANES - 1]) == list(range(1, LANES))  # lane 0 is the default tenant's
    assert [store.tenant_lane(t, LANES) for t in tenants] == given  # given once
    counts = [given.count(lane) + (lane == 0) for lane in range(LANES)]
    assert max(counts) - min(counts) <= 1  # then spread evenly


def test_a_tenants_messages_go_to_its_lane_of_each_pool(store: Store,
                                                        broker: StubBroker) -> None:
    readiness = JobOptions(canvas=False)  # a canvas step's queue is in its signature
    acme = jobs.submit_document(store, DOC, options=readiness, tenant="acme")
    default = jobs.submit_document(store, DOC, options=readiness)
    broker.join()
    assert status(store, acme) == status(store, default) == "completed"
    lane = store.tenant_lane("acme", LANES)
    assert lane != 0
    queues = {(m.args[0], m.name): m.queue for m in broker.sent}
    assert queues[(acme, dispatch.START_TASK)] == lanes("agent")[lane]
    assert queues[(acme, dispatch.ACTION_TASK)] == lanes("tool")[lane]
    assert queues[(default, dispatch.START_TASK)] == "agent"
    assert queues[(default, dispatch.ACTION_TASK)] == "tool"
