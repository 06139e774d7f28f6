"""Client tools (`JobOptions.client_tools`, AG-UI's frontend tools): offered to the model like
the agent's own, a call to one is held like an approval (never sent to a pool) until
`lifecycle.answer_client_call` records the client's answer as its result."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from cortex_worker.actions import dispatch
from cortex_worker.errors import SubmitError
from cortex_worker.jobs import lifecycle
from cortex_worker.jobs.options import ClientTool, JobOptions
from cortex_worker.recovery.reconciler import Reconciler
from cortex_worker.settings import get_settings
from cortex_worker.store.keys import job_keys
from cortex_worker.store.state import Store
from cortex_worker.testing import StubBroker
from tests.engine.helpers import events, of, one, status
from tests.fake_llm import FakeLLM, Turn

PICK = ClientTool(name="pick_color", description="Ask the user to pick a colour.",
                  parameters={"type": "object", "properties": {"hint": {"type": "string"}},
                              "required": ["hint"]})


def options(model: str) -> JobOptions:
    return JobOptions(model=model, client_tools=[PICK])


def call(ident: str = "c") -> str:
    body = json.dumps({"name": "pick_color", "parameters": {"hint": "warm"}})
    return f'<action type="tool" mode="sync" id="{ident}">{body}</action>'


def test_a_client_tool_call_waits_for_the_client_and_its_answer_is_the_result(
        store: Store, broker: StubBroker, llm: FakeLLM) -> None:
    model = f"engine-{uuid.uuid4().hex[:8]}"
    llm.script(model, [Turn(text=call(), tokens_per_second=5000.0),
                       Turn(text='<response final="true">You picked $c.</response>',
                            tokens_per_second=5000.0)])
    job_id = lifecycle.submit_agent(store, "tester", "Pick a colour.", options=options(model))
    broker.join()
    system = llm.requests(model)[0]["messages"][0]["content"]
    assert "- pick_color: Ask the user to pick a colour." in system
    assert store.actions(job_id)["c"]["status"] == "awaiting_approval"
    assert not [m for m in broker.sent if m.name == dispatch.ACTION_TASK]  # never on a pool
    request = one(events(store, job_id), "approval_requested", "c")
    assert request["client"] is True and request["parameters"] == {"hint": "warm"}
    assert store.waiting_for_people(job_id) is not None
    assert lifecycle.decide_approval(store, job_id, "c", approve=True, by="ops") == "none"

    assert lifecycle.answer_client_call(store, job_id, "c", "crimson") == "ok"
    assert lifecycle.answer_client_call(store, job_id, "c", "blue") == "duplicate"
    broker.join()
    assert status(store, job_id) == "completed"
    assert store.get_job(job_id).result == "You picked crimson."
    assert one(events(store, job_id), "action_completed", "c")["result"] == "crimson"
    # answered: an expiry later rejects nothing
    assert lifecycle.decide_approval(store, job_id, "c", approve=False, by="timeout") == "was_answered"


def test_a_client_error_is_the_calls_error_and_an_unanswered_call_expires(
        store: Store, broker: StubBroker, llm: FakeLLM) -> None:
    model = f"engine-{uuid.uuid4().hex[:8]}"
    llm.script(model, [Turn(text=call("a"), tokens_per_second=5000.0),
                       Turn(text=call("b"), tokens_per_second=5000.0),
                       Turn(text='<response final="true">No colour.</response>',
                            tokens_per_second=5000.0)])
    job_id = lifecycle.submit_agent(store, "tester", "Pick a colour.", options=options(model))
    broker.join()
    assert lifecycle.answer_client_call(store, job_id, "a", None,
                                        error="the user closed the dialog") == "error"
    broker.join()
    second = llm.requests(model)[1]["messages"][-1]["content"]
    assert '<result id="a" status="error">the user closed the dialog</result>' in second
    assert store.actions(job_id)["b"]["status"] == "awaiting_approval"
    key = job_keys(job_id).approvals
    request = json.loads(store.redis.hget(key, "b") or "{}")
    request["expires_at"] = time.time() - 1  # time passes
    store.redis.hset(key, "b", json.dumps(request))
    Reconciler(store, get_settings()).reconcile()
    broker.join()
    wait = get_settings().approval_timeout_s
    assert one(events(store, job_id), "action_failed", "b")["error"] == \
        f"rejected by timeout: no answer within {wait:g} s"
    assert lifecycle.answer_client_call(store, job_id, "b", "late") in ("was_rejected", "ended")
    assert status(store, job_id) == "completed"


def test_a_native_model_gets_client_tools_as_functions(
        store: Store, broker: StubBroker, llm: FakeLLM) -> None:
    model = f"engine-{uuid.uuid4().hex[:8]}"
    llm.script(model, [
        Turn(tool_calls=[{"id": "call_1", "name": "pick_color", "arguments": {"hint": "cool"}}],
             tokens_per_second=5000.0),
        Turn(text="Teal it is.", tokens_per_second=5000.0)])
    job_id = lifecycle.submit_agent(store, "native", "Pick a colour.", options=options(model))
    broker.join()
    first = llm.requests(model)[0]
    assert [t["function"]["name"] for t in first["tools"]] == ["echo", "calculator",
                                                                "pick_color"]
    (action_id,) = [a for a, s in store.actions(job_id).items()
                    if s["status"] == "awaiting_approval"]
    assert lifecycle.answer_client_call(store, job_id, action_id, "teal") == "ok"
    broker.join()
    assert status(store, job_id) == "completed"
    answered = llm.requests(model)[1]["messages"][-1]
    assert answered == {"role": "tool", "tool_call_id": "call_1", "content": "teal"}


def test_a_client_tool_named_like_an_agents_tool_is_refused_at_submit(store: Store) -> None:
    clash = JobOptions(client_tools=[ClientTool(name="echo")])
    with pytest.raises(SubmitError, match="client tool 'echo' clashes with tool 'echo' of "
                                          "agent 'tester'"):
        lifecycle.submit_agent(store, "tester", "Hi.", options=clash)
    twice = JobOptions(client_tools=[PICK, ClientTool(name="pick_color")])
    with pytest.raises(SubmitError, match="clashes with client tool 'pick_color'"):
        lifecycle.submit_agent(store, "tester", "Hi.", options=twice)


def test_an_agent_without_the_client_tool_cannot_call_it(
        store: Store, broker: StubBroker, llm: FakeLLM) -> None:
    model = f"engine-{uuid.uuid4().hex[:8]}"
    llm.script(model, [Turn(text=call(), tokens_per_second=5000.0),
                       Turn(text='<response final="true">Could not.</response>',
                            tokens_per_second=5000.0)])
    job_id = lifecycle.submit_agent(store, "tester", "Pick.", options=JobOptions(model=model))
    broker.join()
    assert "not available to agent 'tester'" in one(events(store, job_id), "action_failed",
                                                    "c")["error"]
    assert of(events(store, job_id), "approval_requested", "c") == []
    assert status(store, job_id) == "completed"
