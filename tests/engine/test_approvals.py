"""Actions that wait for a person (`cortex_worker.jobs.approvals`, `jobs.decide_approval`).

`deploy` (tests/manifests/tools.yaml) has `require_approval: true`; the agent `cautious`
(agents.yaml) requires approval of its `calculator` calls and rejects unanswered requests
after 2 s.
"""

from __future__ import annotations

import json
import time
import uuid

from cortex_worker.actions import dispatch
from cortex_worker.jobs import lifecycle
from cortex_worker.jobs.options import JobOptions
from cortex_worker.recovery.reconciler import Reconciler
from cortex_worker.settings import get_settings
from cortex_worker.store.keys import job_keys
from cortex_worker.store.state import Store
from cortex_worker.testing import StubBroker
from tests.engine.helpers import action, events, of, one, status
from tests.fake_llm import FakeLLM, Turn

DOCUMENT = (action("a", "echo", {"message": "v1"})
            + action("d", "deploy", {"target": "$a"})
            + action("after", "echo", {"message": "$d"})
            + action("b", "echo", {"message": "independent"}))


def action_status(store: Store, job_id: str, action_id: str) -> str:
    return store.actions(job_id)[action_id]["status"]


def test_an_action_waits_for_approval_without_a_message_then_runs(
        store: Store, broker: StubBroker) -> None:
    job_id = lifecycle.submit_document(store, DOCUMENT)  # canvas on: a gated plan runs by readiness
    broker.join()
    assert status(store, job_id) == "running"
    assert action_status(store, job_id, "d") == "awaiting_approval"
    assert action_status(store, job_id, "b") == "ok"  # nothing it does not depend on waits
    assert action_status(store, job_id, "after") == "pending"
    assert not [m for m in broker.sent if m.name == dispatch.ACTION_TASK and m.args[1] == "d"]
    log = events(store, job_id)
    request = one(log, "approval_requested", "d")
    assert request["parameters"] == {"target": "v1"}  # after substitution
    assert (request["type"], request["name"]) == ("tool", "deploy")
    assert request["timeout_s"] == get_settings().approval_timeout_s
    assert Reconciler(store, get_settings()).reconcile() == 0  # not lost: waiting

    assert lifecycle.decide_approval(store, job_id, "d", approve=True, by="ops") == "approved"
    assert lifecycle.decide_approval(store, job_id, "d", approve=True, by="ops") == "was_approved"
    assert lifecycle.decide_approval(store, job_id, "d", approve=False, by="ops") == "was_approved"
    broker.join()
    assert status(store, job_id) == "completed"
    log = events(store, job_id)
    assert one(log, "action_approved", "d") == {"action_id": "d", "by": "ops", "reason": None}
    assert one(log, "action_completed", "d")["result"] == {"deployed": "v1"}
    assert one(log, "action_completed", "after")["result"] == {"deployed": "v1"}


def test_a_rejected_action_fails_with_the_reason_and_its_dependents_are_skipped(
        store: Store, broker: StubBroker) -> None:
    job_id = lifecycle.submit_document(store, DOCUMENT, options=JobOptions(canvas=False))
    broker.join()
    assert lifecycle.decide_approval(store, job_id, "d", approve=False, by="ops",
                                reason="not on a Friday") == "rejected"
    broker.join()
    log = events(store, job_id)
    kinds = [e["type"] for e in log]
    assert kinds.index("approval_requested") < kinds.index("action_rejected") \
        < kinds.index("action_failed")
    assert one(log, "action_rejected", "d")["reason"] == "not on a Friday"
    assert one(log, "action_failed", "d")["error"] == "rejected by ops: not on a Friday"
    assert action_status(store, job_id, "after") == "skipped"
    assert status(store, job_id) == "failed"
    assert lifecycle.decide_approval(store, job_id, "d", approve=True, by="ops") == "ended"


def test_an_unanswered_request_is_rejected_by_the_reconciler_when_it_expires(
        store: Store, broker: StubBroker) -> None:
    job_id = lifecycle.submit_document(store, DOCUMENT, options=JobOptions(canvas=False))
    broker.join()
    key = job_keys(job_id).approvals
    request = json.loads(store.redis.hget(key, "d") or "{}")
    assert request["state"] == "requested"
    reconciler = Reconciler(store, get_settings())
    reconciler.reconcile()
    assert action_status(store, job_id, "d") == "awaiting_approval"  # not yet expired

    request["expires_at"] = time.time() - 1  # time passes
    store.redis.hset(key, "d", json.dumps(request))
    reconciler.reconcile()
    broker.join()
    wait = get_settings().approval_timeout_s
    assert one(events(store, job_id), "action_failed", "d")["error"] == \
        f"rejected by timeout: no answer within {wait:g} s"


def test_cancelling_the_job_cancels_a_waiting_action(store: Store, broker: StubBroker) -> None:
    job_id = lifecycle.submit_document(store, DOCUMENT, options=JobOptions(canvas=False))
    broker.join()
    assert lifecycle.cancel_job(store, job_id)
    assert action_status(store, job_id, "d") == "cancelled"
    assert lifecycle.decide_approval(store, job_id, "d", approve=True, by="ops") == "ended"
    assert lifecycle.decide_approval(store, job_id, "b", approve=True, by="ops") == "ended"


def test_an_action_that_needs_no_approval_cannot_be_approved(
        store: Store, broker: StubBroker) -> None:
    job_id = lifecycle.submit_document(store, DOCUMENT, options=JobOptions(canvas=False))
    broker.join()
    assert lifecycle.decide_approval(store, job_id, "b", approve=True, by="ops") == "none"


# ---------------------------------------------------------------- agents


def test_an_agent_policy_holds_its_calls_and_the_model_reads_a_rejection(
        store: Store, broker: StubBroker, llm: FakeLLM) -> None:
    model = f"engine-{uuid.uuid4().hex[:8]}"
    calc = json.dumps({"name": "calculator", "parameters": {"expression": "6 * 7"}})
    echo = json.dumps({"name": "echo", "parameters": {"message": "fine"}})
    llm.script(model, [
        Turn(text=f'<action type="tool" mode="async" id="calc">{calc}</action>'
                  f'<action type="tool" mode="async" id="e">{echo}</action>',
             tokens_per_second=5000.0),
        Turn(text='<response final="true">I could not compute it.</response>',
             tokens_per_second=5000.0),
    ])
    job_id = lifecycle.submit_agent(store, "cautious", "Compute 6*7.",
                               options=JobOptions(model=model))
    broker.join()
    assert action_status(store, job_id, "calc") == "awaiting_approval"
    assert action_status(store, job_id, "e") == "ok"
    request = one(events(store, job_id), "approval_requested", "calc")
    assert request["timeout_s"] == 2  # the agent's own approval.timeout_s

    assert lifecycle.decide_approval(store, job_id, "calc", approve=False, by="ops",
                                reason="use the echo") == "rejected"
    broker.join()
    assert status(store, job_id) == "completed"
    second = llm.requests(model)[1]["messages"][-1]["content"]
    assert '<result id="calc" status="error">rejected by ops: use the echo</result>' in second
    assert of(events(store, job_id), "action_started", "calc") == []
