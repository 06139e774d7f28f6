"""A tenant's cap on jobs running at once (cortex_worker.jobs.tenants), in-process: a job
beyond it stays queued until one of the tenant's jobs ends; other tenants are not held; child
jobs are not counted; a place whose release was lost is found again."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest

from cortex_worker.actions import dispatch
from cortex_worker.jobs import lifecycle as jobs
from cortex_worker.jobs.options import JobOptions
from cortex_worker.settings import get_settings
from cortex_worker.store.keys import tenant_running_key
from cortex_worker.store.state import Store
from cortex_worker.testing import StubBroker
from tests.engine.helpers import events, status
from tests.fake_llm import FakeLLM, Turn

FAST = 5000.0


@pytest.fixture(autouse=True)
def capped(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """acme runs one job at a time."""
    monkeypatch.setenv("CORTEX_QUOTAS", json.dumps({"acme": {"max_running_jobs": 1}}))
    get_settings.cache_clear()
    yield
    monkeypatch.delenv("CORTEX_QUOTAS")
    get_settings.cache_clear()


def act(ident: str) -> str:
    body = json.dumps({"name": "calculator", "parameters": {"expression": "1 + 1"}})
    return f'<action type="tool" mode="sync" id="{ident}">{body}</action>'


def two_turns(llm: FakeLLM) -> str:
    model = f"engine-{uuid.uuid4().hex[:8]}"
    llm.script(model, [Turn(text=act("a"), tokens_per_second=FAST),
                       Turn(text='<response final="true">2</response>', tokens_per_second=FAST)])
    return model


def at(store: Store, job_id: str, kind: str) -> float:
    """When the job's one event of `kind` was logged (a seq is per job: across jobs, the
    order of their writes is the order of their times, all taken by this process)."""
    (ts,) = [e["ts"] for e in events(store, job_id) if e["type"] == kind]
    return float(ts)


def test_a_job_beyond_the_cap_waits_until_one_ends(store: Store, broker: StubBroker,
                                                  llm: FakeLLM) -> None:
    first = jobs.submit_agent(store, "tester", "1+1?", options=JobOptions(model=two_turns(llm)),
                              tenant="acme")
    second = jobs.submit_agent(store, "tester", "1+1?", options=JobOptions(model=two_turns(llm)),
                               tenant="acme")
    other = jobs.submit_agent(store, "tester", "1+1?", options=JobOptions(model=two_turns(llm)),
                              tenant="globex")
    broker.join(delayed=False)  # everything that need not wait
    assert status(store, first) == status(store, other) == "completed"
    assert status(store, second) == "queued"  # held back: acme's first job was running
    held = [m for m in broker.messages(dispatch.TURN_TASK) if m.args == [second]]
    assert len(held) == 1 and held[0].task_id == f"{second}:start" and held[0].delayed
    broker.join()
    assert status(store, second) == "completed"
    assert at(store, second, "job_started") >= at(store, first, "job_completed")
    assert store.redis.smembers(tenant_running_key("acme")) == set()  # each released its place


def test_a_document_beyond_the_cap_waits_too(store: Store, broker: StubBroker) -> None:
    doc = '<action type="tool" mode="async" id="e">{"name": "echo", "parameters": {"text": "x"}}</action>'
    store.redis.sadd(tenant_running_key("acme"), "some-running-job")  # acme is at its cap
    store.create_job("some-running-job", {"kind": "document", "tenant": "acme",
                                          "status": "running"}, 60)
    job_id = jobs.submit_document(store, doc, tenant="acme")
    broker.join(delayed=False)
    assert status(store, job_id) == "queued"
    store.close("some-running-job", "completed")  # its end's release was lost: found again
    broker.join()
    assert status(store, job_id) == "completed"
    assert store.redis.smembers(tenant_running_key("acme")) == set()


def test_a_tenants_actions_beyond_its_cap_wait_for_a_slot_others_do_not(
        store: Store, broker: StubBroker, monkeypatch: pytest.MonkeyPatch) -> None:
    """`max_actions_in_flight`: acme's actions take a slot of the gate `tenant:acme` (as a
    `max_concurrency` tool's do of its own); with every slot held, its action waits `queued`
    (nothing claimed or logged) and is sent when one frees; globex's run meanwhile."""
    from cortex_worker.actions import executor
    from tests.engine.helpers import action

    monkeypatch.setenv("CORTEX_QUOTAS", json.dumps({"acme": {"max_actions_in_flight": 1}}))
    get_settings.cache_clear()
    assert store.take_slot("tenant:acme", "elsewhere:x", 1, 60.0, None)  # another action runs
    readiness = JobOptions(canvas=False)  # a canvas step waits in its chain instead (retries)
    held = jobs.submit_document(store, action("a", "echo", {"message": "acme"}), tenant="acme",
                                options=readiness)
    free = jobs.submit_document(store, action("a", "echo", {"message": "globex"}),
                                tenant="globex", options=readiness)
    broker.join()
    assert status(store, free) == "completed"
    assert status(store, held) == "running"
    assert store.action_status(held, "a") == "queued"
    assert [e["type"] for e in events(store, held) if e["type"].startswith("action_")] == [
        "action_parsed", "action_queued"]
    executor._give_back(store, [("tenant:acme", 1)], "elsewhere:x")  # that action ended
    broker.join()
    assert status(store, held) == "completed"
    assert store.slots_in_use("tenant:acme") == 0
