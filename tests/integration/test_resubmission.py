"""A client that sends a request again (its answer timed out, its connection broke) with the
same idempotency key gets the job the first copy made, and nothing runs twice: over HTTP
(`Idempotency-Key` on `POST /v1/jobs` and on a session's messages, the SDK's
`idempotency_key`) and over A2A (a message sent again keeps its `messageId`). The real API,
workers and fake model server; the engine's own checks (tenants, races, a lost start) are
tests/engine/test_resubmission.py's."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import httpx
import pytest
from a2a.utils.errors import InvalidParamsError

from cortex_api.client import Client
from cortex_api.models import JobOptions
from tests import harness
from tests.fake_llm import FakeLLM
from tests.integration.test_a2a import a2a_client, collect, request
from tests.integration.test_agents import final, finish, turn, unique
from tests.integration.test_documents import action, of


@pytest.fixture
def api(workers: Any, api: harness.Process) -> harness.Process:  # the jobs need the pools
    return api


def post(api: harness.Process, body: dict[str, Any], key: str) -> httpx.Response:
    return httpx.post(f"{api.url}/v1/jobs", json=body, headers={"Idempotency-Key": key},
                      timeout=30)


def test_a_job_sent_again_with_its_key_runs_once(api: harness.Process) -> None:
    key = uuid.uuid4().hex
    body = {"protocol": action("a", "echo", {"message": key}) + "<response>$a</response>"}
    first, again = post(api, body, key), post(api, body, key)
    assert first.status_code == again.status_code == 202, (first.text, again.text)
    assert first.json()["id"] == again.json()["id"]
    assert "Idempotent-Replayed" not in first.headers
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.headers["Location"] == first.headers["Location"]
    log = finish(api, first.json()["id"])
    assert log[-1]["type"] == "job_completed" and log[-1]["data"]["result"] == key
    assert len(of(log, "job_queued")) == 1 and len(of(log, "action_started")) == 1
    after = post(api, body, key)  # once the job has ended too
    assert after.json()["id"] == first.json()["id"] and after.headers["Idempotent-Replayed"]

    other = post(api, {"protocol": "<response>something else</response>"}, key)
    assert other.status_code == 422, other.text
    detail = other.json()["detail"]
    assert detail["errors"][0]["kind"] == "idempotency_key_reused"
    assert first.json()["id"] in detail["message"]
    fresh = post(api, body, uuid.uuid4().hex)  # another key: another job
    assert fresh.status_code == 202 and fresh.json()["id"] != first.json()["id"]
    assert post(api, body, "").status_code == 422  # an empty key is refused, not ignored


def test_copies_sent_at_once_get_one_job(api: harness.Process) -> None:
    key = uuid.uuid4().hex
    body = {"protocol": action("a", "sleep", {"seconds": 0.2})}
    gate = threading.Barrier(8)
    answers: list[httpx.Response] = []

    def send() -> None:
        gate.wait()
        answers.append(post(api, body, key))

    threads = [threading.Thread(target=send) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {a.status_code for a in answers} == {202}
    assert len({a.json()["id"] for a in answers}) == 1
    assert sum("Idempotent-Replayed" not in a.headers for a in answers) == 1
    log = finish(api, answers[0].json()["id"])
    assert len(of(log, "job_queued")) == 1 and len(of(log, "action_started")) == 1


def test_the_sdk_sends_its_key(api: harness.Process, fake_llm: FakeLLM) -> None:
    model = unique("resubmit-sdk")
    fake_llm.script(model, [turn(final("only once"))])
    key = uuid.uuid4().hex
    with Client(api.url) as client:
        first = client.submit_agent("tester", "hello", options=JobOptions(model=model),
                                    idempotency_key=key)
        again = client.submit_agent("tester", "hello", options=JobOptions(model=model),
                                    idempotency_key=key)
        assert first.id == again.id
        assert client.wait(first.id, timeout=30).result == "only once"
    assert fake_llm.remaining(model) == 0 and len(fake_llm.requests(model)) == 1


def test_a_session_message_sent_again_is_not_a_second_message(api: harness.Process,
                                                              fake_llm: FakeLLM) -> None:
    model = unique("resubmit-session")
    fake_llm.script(model, [turn(final("Hi."), delay_s=0.5)])
    session = httpx.post(f"{api.url}/v1/sessions", json={"agent": "tester",
                                                         "options": {"model": model}}).json()["id"]
    key = uuid.uuid4().hex

    def send() -> httpx.Response:
        return httpx.post(f"{api.url}/v1/sessions/{session}/messages", json={"content": "Hello"},
                          headers={"Idempotency-Key": key}, timeout=30)

    first, again = send(), send()  # the first job still runs: without the key, a 409
    assert first.status_code == again.status_code == 202, (first.text, again.text)
    assert first.json()["id"] == again.json()["id"] and again.headers["Idempotent-Replayed"]
    assert finish(api, first.json()["id"])[-1]["data"]["result"] == "Hi."
    view = httpx.get(f"{api.url}/v1/sessions/{session}").json()
    assert [m["content"] for m in view["messages"] if m["role"] == "user"] == ["Hello"]
    assert view["jobs"] == [first.json()["id"]]


def test_an_a2a_message_sent_again_gets_its_task(api: harness.Process,
                                                 fake_llm: FakeLLM) -> None:
    """A2A's messageId identifies a message: a client's retry of `SendMessage` (the same
    message) gets the task the first started, in the same context, and no second task."""
    model = unique("resubmit-a2a")
    fake_llm.script(model, [turn(final("forty-two"), delay_s=0.3)])
    params = request("the answer?", model, immediately=True)

    changed = request("another question?", model, immediately=True)
    changed.message.message_id = params.message.message_id

    async def main() -> tuple[Any, Any, Exception]:
        async with a2a_client(api.url) as (client, _):
            [first] = await collect(client.send_message(params))
            [again] = await collect(client.send_message(params))
            with pytest.raises(InvalidParamsError) as refused:
                await collect(client.send_message(changed))
            return first.task, again.task, refused.value

    first, again, refused = asyncio.run(main())
    assert "another request" in str(refused)
    assert again.id == first.id and again.context_id == first.context_id
    assert finish(api, first.id)[-1]["data"]["result"] == "forty-two"
    session = httpx.get(f"{api.url}/v1/sessions/{first.context_id}").json()
    assert session["jobs"] == [first.id]
    assert fake_llm.remaining(model) == 0 and len(fake_llm.requests(model)) == 1
