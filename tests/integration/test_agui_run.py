"""`POST /v1/agents/{name}/ag-ui` driven by AG-UI's reference client (`@ag-ui/client`'s
`HttpAgent`, its own verification on; tests/agui_client.py) against the real API and workers."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cortex_api.routes.agui import thread_session
from cortex_worker.store.keys import session_key
from tests import harness
from tests.agui_checks import assert_well_formed, parse
from tests.agui_client import Step, StepReport, run_client, user
from tests.fake_llm import FakeLLM
from tests.integration.test_agents import act, final, turn, unique, view


@pytest.fixture
def api(workers: Any, api: harness.Process) -> harness.Process:
    return api


def endpoint(api: harness.Process, agent: str = "tester") -> str:
    return f"{api.url}/v1/agents/{agent}/ag-ui"


def props(model: str) -> dict[str, Any]:
    """forwardedProps choosing the fake model's script (the thread's job options)."""
    return {"cortex": {"options": {"model": model}}}


def thread() -> str:
    return f"thread-{uuid.uuid4().hex[:8]}"


def test_a_new_thread_streams_a_whole_run(api: harness.Process, fake_llm: FakeLLM) -> None:
    model = unique("agui-run")
    fake_llm.script(model, [
        turn("<thought>Adding.</thought>\n" + act("sum", "calculator", {"expression": "19 + 23"})),
        turn(final("The sum is $sum.")),
    ])
    tid = thread()
    report = run_client(endpoint(api), thread_id=tid, steps=[
        Step("run-1", [user("Add 19 and 23.")], forwarded_props=props(model))])
    run = report.steps[0]
    assert run.error is None and report.warnings == []
    assert_well_formed(run.events)
    started, job = run.events[0], run.events[1]
    assert (started["type"], started["threadId"], started["runId"]) == ("RUN_STARTED", tid, "run-1")
    assert job["type"] == "CUSTOM" and job["name"] == "cortex.run"
    job_id = job["value"]["jobId"]
    finished = run.events[-1]
    assert finished["type"] == "RUN_FINISHED" and finished["runId"] == "run-1"
    assert finished["result"] == "The sum is 42." and finished["usage"][0]["totalTokens"] > 0
    assert view(api, job_id)["status"] == "completed"
    texts = [m["content"] for m in report.messages if m["role"] == "assistant" and m.get("content")]
    assert texts == ["The sum is 42."]


def sse_events(response: httpx.Response,
               until: Any = None) -> list[tuple[int | None, dict[str, Any]]]:
    """(SSE id, AG-UI event) of a streamed answer; with `until(messages)`, stops there."""
    out: list[tuple[int | None, dict[str, Any]]] = []
    fields: dict[str, str] = {}
    for line in response.iter_lines():
        if line:
            if not line.startswith(":"):
                name, _, value = line.partition(": ")
                fields[name] = value
            continue
        if "data" in fields:
            parse(fields["data"])
            out.append((int(fields["id"]) if "id" in fields else None, json.loads(fields["data"])))
            if until is not None and until(out):
                return out
        fields = {}
    return out


def test_a_run_posted_again_attaches_to_its_job_and_replays_it(api: harness.Process,
                                                                fake_llm: FakeLLM) -> None:
    model = unique("agui-attach")
    held = threading.Event()
    fake_llm.script(model, [
        turn("<thought>Thinking it over slowly, then adding.</thought>\n"
             + act("sum", "calculator", {"expression": "19 + 23"}), chunk_chars=4,
             holds={4: held}),
        turn(final("The sum is $sum.")),
    ])
    tid = thread()
    body = {"threadId": tid, "runId": "run-1", "messages": [user("Add 19 and 23.")],
            "forwardedProps": props(model)}

    def thinking(seen: list[tuple[int | None, dict[str, Any]]]) -> bool:
        return any(e["type"] == "REASONING_MESSAGE_CONTENT" for _, e in seen)

    with httpx.stream("POST", endpoint(api), json=body, timeout=30) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        first = sse_events(response, until=thinking)
    held.set()
    open_thought = next(e["messageId"] for _, e in first if e["type"] == "REASONING_START")
    last_id = first[-1][0]
    assert last_id is not None
    # the same run, joined after the last id received: AG-UI's client accepts it mid-run
    joined = run_client(endpoint(api), thread_id=tid, steps=[
        Step("run-1", [user("Add 19 and 23.")], headers={"Last-Event-ID": str(last_id)})])
    # and replayed whole, once it ended, by yet another client: still the one job
    replayed = run_client(endpoint(api), thread_id=tid, steps=[
        Step("run-1", [user("Add 19 and 23.")])])
    for report in (joined, replayed):
        assert report.steps[0].error is None and report.warnings == []
        assert_well_formed(report.steps[0].events)
    resumed = joined.steps[0].events
    assert [e["type"] for e in resumed[:4]] == ["RUN_STARTED", "CUSTOM", "STEP_STARTED",
                                                "REASONING_START"]
    assert resumed[0]["runId"] == "run-1" and resumed[3]["messageId"] == open_thought
    whole = replayed.steps[0].events

    def thought(events: list[dict[str, Any]]) -> str:
        return "".join(e["delta"] for e in events if e["type"] == "REASONING_MESSAGE_CONTENT")

    assert thought([e for _, e in first]) + thought(resumed) == thought(whole) \
        == "Thinking it over slowly, then adding."
    jobs = {e["value"]["jobId"] for r in (joined, replayed) for e in r.steps[0].of("CUSTOM")
            if e["name"] == "cortex.run"} | {e["value"]["jobId"] for _, e in first
                                             if e["type"] == "CUSTOM" and e["name"] == "cortex.run"}
    assert len(jobs) == 1
    assert whole[-1]["type"] == "RUN_FINISHED" and whole[-1]["result"] == "The sum is 42."
    session = view_session(api, jobs.pop())
    assert len(session["jobs"]) == 1


def well_formed(events: list[dict[str, Any]], *earlier: StepReport) -> None:
    """`assert_well_formed`, where a run that goes on after an interrupt may answer the calls
    of earlier runs (AG-UI: the result comes in the resumed run, under the original id)."""
    called = {e["toolCallId"] for step in earlier for e in step.of("TOOL_CALL_END")}
    assert_well_formed([e for e in events
                        if e["type"] != "TOOL_CALL_RESULT" or e["toolCallId"] not in called])


def turns(api: harness.Process, job_id: str) -> list[dict[str, Any]]:
    """The `usage` events of a job: one per model call."""
    response = httpx.get(f"{api.url}/v1/jobs/{job_id}/events", timeout=30)
    return [json.loads(line[6:])["data"] for line in response.text.splitlines()
            if line.startswith("data: ") and '"type":"usage"' in line.replace(" ", "")]


def view_session(api: harness.Process, job_id: str) -> dict[str, Any]:
    """The session a job of a thread belongs to."""
    job = view(api, job_id)
    response = httpx.get(f"{api.url}/v1/sessions/{job['session']}", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_an_approval_is_an_interrupt_and_the_next_run_resumes_the_job(
        api: harness.Process, fake_llm: FakeLLM) -> None:
    model = unique("agui-approve")
    fake_llm.script(model, [
        turn(act("d", "deploy", {"target": "web-1"})),
        turn(final("Done: $d.")),
    ])
    tid = thread()
    report = run_client(endpoint(api), thread_id=tid, steps=[
        Step("run-1", [user("Deploy web-1.")], forwarded_props=props(model)),
        Step("run-2", resume={"approved": True}),
    ])
    assert report.warnings == [] and [s.error for s in report.steps] == [None, None]
    first, second = report.steps
    well_formed(first.events)
    well_formed(second.events, first)
    job_id = first.of("CUSTOM")[0]["value"]["jobId"]
    call = f"{job_id}:d"
    paused = first.events[-1]
    assert paused["type"] == "RUN_FINISHED" and paused["runId"] == "run-1"
    (interrupt,) = paused["outcome"]["interrupts"]
    assert paused["outcome"]["type"] == "interrupt"
    assert (interrupt["id"], interrupt["reason"], interrupt["toolCallId"]) == (
        f"{job_id}:d:approval", "tool_call", call)
    assert interrupt["responseSchema"]["required"] == ["approved"]
    assert interrupt["metadata"]["cortex"]["parameters"] == {"target": "web-1"}
    assert [e["toolCallId"] for e in first.of("TOOL_CALL_START")] == [call]
    assert first.pending_interrupts == [interrupt] and second.pending_interrupts == []
    # the resumed run: the same job goes on; its call's result, then the answer
    assert second.events[0]["type"] == "RUN_STARTED" and second.events[0]["runId"] == "run-2"
    assert second.of("CUSTOM")[0]["value"]["jobId"] == job_id
    assert second.of("TOOL_CALL_START") == []
    (result,) = second.of("TOOL_CALL_RESULT")
    assert result["toolCallId"] == call and json.loads(result["content"]) == {"deployed": "web-1"}
    done = second.events[-1]
    assert done["type"] == "RUN_FINISHED" and "outcome" not in done
    assert done["result"] == 'Done: {"deployed": "web-1"}.'
    job = view(api, job_id)
    assert job["status"] == "completed" and len(view_session(api, job_id)["jobs"]) == 1
    # each run reports the model calls it made: one each, adding up to the job's
    (used,) = job["usage"].values()
    runs = [paused["usage"][0], done["usage"][0]]
    assert [u["inputTokens"] for u in runs] == [t["prompt_tokens"] for t in turns(api, job_id)]
    assert sum(u["inputTokens"] for u in runs) == used["prompt_tokens"]


def test_a_rejected_interrupt_fails_the_call_and_open_interrupts_block_new_input(
        api: harness.Process, fake_llm: FakeLLM) -> None:
    model = unique("agui-reject")
    fake_llm.script(model, [
        turn(act("d", "deploy", {"target": "web-2"})),
        turn(final("Not deployed.")),
    ])
    tid = thread()
    first = run_client(endpoint(api), thread_id=tid, steps=[
        Step("run-1", [user("Deploy web-2.")], forwarded_props=props(model))])
    assert first.steps[0].events[-1]["outcome"]["type"] == "interrupt"
    # a client that does not know of the interrupt sends a new message: refused (AG-UI rule 4)
    blocked = run_client(endpoint(api), thread_id=tid, steps=[Step("run-x", [user("Hello?")])])
    (refusal,) = blocked.steps[0].events
    assert refusal["type"] == "RUN_ERROR" and refusal["code"] == "interrupted"
    # an answer to an interrupt the thread does not have, or one that misses it: refused too
    (interrupt,) = first.steps[0].events[-1]["outcome"]["interrupts"]
    wrong = run_client(endpoint(api), thread_id=tid, steps=[
        Step("run-y", resume=[{"interruptId": "nope", "status": "resolved",
                               "payload": {"approved": True}}]),
        Step("run-z", resume=[{"interruptId": interrupt["id"], "status": "resolved",
                               "payload": {"approve": "yes"}}])])
    assert [s.events[0]["code"] for s in wrong.steps] == ["unknown_interrupt", "invalid_resume"]
    rejected = run_client(endpoint(api), thread_id=tid, steps=[Step("run-2", resume=[
        {"interruptId": interrupt["id"], "status": "resolved",
         "payload": {"approved": False, "reason": "change freeze"}}])])
    run = rejected.steps[0]
    assert run.error is None and rejected.warnings == []
    well_formed(run.events, first.steps[0])
    (result,) = run.of("TOOL_CALL_RESULT")
    assert result["content"] == "error: rejected by ag-ui: change freeze"
    assert run.events[-1]["type"] == "RUN_FINISHED" and run.events[-1]["result"] == "Not deployed."


PICK = {"name": "pick_color", "description": "Ask the user to pick a colour.",
        "parameters": {"type": "object", "properties": {"hint": {"type": "string"}},
                       "required": ["hint"]}}


def test_a_frontend_tool_call_ends_the_run_and_the_next_run_carries_its_result(
        api: harness.Process, fake_llm: FakeLLM) -> None:
    model = unique("agui-frontend")
    fake_llm.script(model, [
        turn(act("c", "pick_color", {"hint": "warm"})),
        turn(final("You picked $c.")),
    ])
    tid = thread()
    first = run_client(endpoint(api), thread_id=tid, steps=[
        Step("run-1", [user("Pick a colour.")], tools=[PICK], forwarded_props=props(model))])
    run = first.steps[0]
    assert run.error is None and first.warnings == []
    assert_well_formed(run.events)
    job_id = run.of("CUSTOM")[0]["value"]["jobId"]
    call = f"{job_id}:c"
    (start,) = run.of("TOOL_CALL_START")
    assert (start["toolCallId"], start["toolCallName"]) == (call, "pick_color")
    assert json.loads(run.of("TOOL_CALL_ARGS")[0]["delta"]) == {"hint": "warm"}
    ended = run.events[-1]
    assert ended["type"] == "RUN_FINISHED" and "outcome" not in ended
    assert run.pending_interrupts == [] and run.of("TOOL_CALL_RESULT") == []
    system = fake_llm.requests(model)[0]["messages"][0]["content"]
    assert "- pick_color: Ask the user to pick a colour." in system
    # the client holds the call; it runs the tool and answers in the next run
    (assistant,) = [m for m in first.messages if m.get("toolCalls")]
    assert [c["id"] for c in assistant["toolCalls"]] == [call]
    answer = {"id": uuid.uuid4().hex, "role": "tool", "toolCallId": call, "content": "crimson"}
    second = run_client(endpoint(api), thread_id=tid, messages=first.messages, steps=[
        Step("run-2", [answer], tools=[PICK])])
    done = second.steps[0]
    assert done.error is None and second.warnings == []
    well_formed(done.events, run)
    assert done.of("CUSTOM")[0]["value"]["jobId"] == job_id  # the same job went on
    assert done.of("TOOL_CALL_START") == [] and done.of("TOOL_CALL_RESULT") == []
    assert done.events[-1]["type"] == "RUN_FINISHED"
    assert done.events[-1]["result"] == "You picked crimson."
    job = view(api, job_id)
    assert job["status"] == "completed" and len(view_session(api, job_id)["jobs"]) == 1
    # answered once: posting the answer again under a new run finds nothing to answer
    again = run_client(endpoint(api), thread_id=tid, messages=first.messages, steps=[
        Step("run-3", [answer], tools=[PICK])])
    assert again.steps[0].events[0]["code"] == "no_interrupt"


def test_a_frontend_tool_named_like_the_agents_tool_is_refused(api: harness.Process) -> None:
    echo = {**PICK, "name": "echo"}
    report = run_client(endpoint(api), thread_id=thread(), steps=[
        Step("run-1", [user("Hi.")], tools=[echo])])
    (refusal,) = report.steps[0].events
    assert refusal["type"] == "RUN_ERROR" and refusal["code"] == "SubmitError"
    assert refusal["message"] == ("client tool 'echo' clashes with tool 'echo' of agent "
                                  "'tester': give it another name")


def test_a_failed_job_ends_its_run_with_run_error(api: harness.Process,
                                                  fake_llm: FakeLLM) -> None:
    model = unique("agui-fail")
    fake_llm.script(model, [turn(fail_status=400, error_message="context length exceeded")])
    report = run_client(endpoint(api), thread_id=thread(), steps=[
        Step("run-1", [user("Hi.")], forwarded_props=props(model))])
    run = report.steps[0]
    assert_well_formed(run.events)
    error = run.events[-1]
    assert error["type"] == "RUN_ERROR" and error["code"] == "job_failed"
    assert error["message"].endswith("answered HTTP 400: context length exceeded")


def test_a_bad_body_is_a_422_that_says_why(api: harness.Process) -> None:
    response = httpx.post(endpoint(api), json={"runId": "r", "messages": []}, timeout=30)
    assert response.status_code == 422
    assert response.json()["detail"]["message"] == "invalid request (body.threadId): Field required"
    response = httpx.post(endpoint(api), json={
        "threadId": thread(), "runId": "r", "messages": [user("Hi.")],
        "forwardedProps": {"cortex": {"options": {"max_parallel": 0}}}}, timeout=30)
    assert response.status_code == 422
    assert "forwardedProps.cortex.options.max_parallel" in response.json()["detail"]["message"]
    response = httpx.post(f"{api.url}/v1/agents/nobody/ag-ui", json={
        "threadId": thread(), "runId": "r", "messages": [user("Hi.")]}, timeout=30)
    assert response.status_code == 404


def test_cors_is_off_by_default(api: harness.Process) -> None:
    preflight = httpx.options(endpoint(api), headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST"}, timeout=30)
    assert "access-control-allow-origin" not in preflight.headers


ORIGIN = "https://app.example"
KEYS = {"acme": "agui-key-of-acme-0123456789", "globex": "agui-key-of-globex-0123456789"}


@pytest.fixture(scope="module")
def guarded_api(workers: Any, cortex_env: dict[str, str], harness_dir: Any
                ) -> Iterator[harness.Process]:
    """An API with API keys (two tenants) and CORS for one browser origin."""
    env = {**cortex_env, "CORTEX_API_KEYS": ",".join(f"{t}:{k}" for t, k in KEYS.items()),
           "CORTEX_CORS_ORIGINS": json.dumps([ORIGIN])}
    with harness.api_running(env, log_dir=harness_dir, cwd=harness_dir) as proc:
        yield proc


def bearer(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def test_api_keys_and_tenants_apply(guarded_api: harness.Process, fake_llm: FakeLLM) -> None:
    model = unique("agui-keys")
    fake_llm.script_default(model, lambda body: turn(final("Hello.")))
    body = {"threadId": "shared-thread", "runId": "shared-run", "messages": [user("Hi.")],
            "forwardedProps": props(model)}
    response = httpx.post(endpoint(guarded_api), json=body, timeout=30)
    assert response.status_code == 401
    assert response.json()["detail"]["message"].startswith("an API key is required")
    wrong = httpx.post(endpoint(guarded_api), json=body, headers={"X-API-Key": "nope"}, timeout=30)
    assert wrong.status_code == 401
    # the same thread and run ids of two tenants are two threads: neither sees the other's job
    jobs = {}
    for tenant in KEYS:
        report = run_client(endpoint(guarded_api), thread_id="shared-thread",
                            headers=bearer(tenant), steps=[
                                Step("shared-run", [user("Hi.")], forwarded_props=props(model))])
        run = report.steps[0]
        assert run.error is None and run.events[-1]["result"] == "Hello."
        jobs[tenant] = run.of("CUSTOM")[0]["value"]["jobId"]
    assert jobs["acme"] != jobs["globex"]
    mine = httpx.get(f"{guarded_api.url}/v1/jobs/{jobs['acme']}", headers=bearer("acme"),
                     timeout=30)
    theirs = httpx.get(f"{guarded_api.url}/v1/jobs/{jobs['acme']}", headers=bearer("globex"),
                       timeout=30)
    assert (mine.status_code, theirs.status_code) == (200, 404)


def test_cors_is_on_for_the_configured_origins(guarded_api: harness.Process) -> None:
    asked = {"Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}
    allowed = httpx.options(endpoint(guarded_api), headers={"Origin": ORIGIN, **asked},
                            timeout=30)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    other = httpx.options(endpoint(guarded_api), headers={"Origin": "https://evil.example",
                                                          **asked}, timeout=30)
    assert "access-control-allow-origin" not in other.headers
    refused = httpx.post(endpoint(guarded_api), json={}, headers={"Origin": ORIGIN}, timeout=30)
    assert refused.status_code == 401  # errors too carry the header, so the page can read them
    assert refused.headers["access-control-allow-origin"] == ORIGIN


def test_a_run_whose_last_message_is_not_the_users_is_a_422(api: harness.Process,
                                                           redis_client: Any) -> None:
    tid = thread()
    response = httpx.post(endpoint(api), json={
        "threadId": tid, "runId": "r", "messages": [
            user("Hi."), {"id": "a1", "role": "assistant", "content": "Hello."}]}, timeout=30)
    assert response.status_code == 422
    assert response.json()["detail"]["message"].startswith(
        "invalid request (body.messages): the last message must be the user's")
    assert not redis_client.exists(session_key(thread_session("default", "tester", tid)))
