"""A2A 1.0: the official `a2a-sdk` client against Cortex's agents (the real API and workers).

Each test scripts the fake model server under a model name of its own, passed to the job as
`metadata.cortex.options.model` of the message that opens a context (`helper` answers).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from a2a.client import A2ACardResolver, ClientConfig, ClientFactory
from a2a.client.client import Client
from a2a.helpers.proto_helpers import new_text_message
from a2a.types.a2a_pb2 import (
    AgentCard,
    CancelTaskRequest,
    GetTaskRequest,
    Role,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskState,
)
from a2a.utils.errors import TaskNotFoundError, UnsupportedOperationError
from google.protobuf.struct_pb2 import Struct

from tests import harness
from tests.fake_llm import FakeLLM
from tests.integration.test_agents import final, turn, unique

AGENT = "helper"
ALPHA, BETA = f"a2a-alpha-{uuid.uuid4().hex}", f"a2a-beta-{uuid.uuid4().hex}"


@pytest.fixture
def api(workers: Any, api: harness.Process) -> harness.Process:  # tasks need the pools
    return api


@pytest.fixture(scope="module")
def keyed_api(cortex_env: dict[str, str], harness_dir: Path) -> Iterator[harness.Process]:
    """An API whose keys name two tenants."""
    env = {**cortex_env, "CORTEX_API_KEYS": f"alpha:{ALPHA},beta:{BETA}"}
    with harness.api_running(env, log_dir=harness_dir, cwd=harness_dir) as proc:
        yield proc


def card_url(base: str, agent: str = AGENT) -> str:
    return f"{base}/v1/a2a/{agent}"


@asynccontextmanager
async def a2a_client(base: str, *, streaming: bool = False, key: str | None = None
                     ) -> AsyncIterator[tuple[Client, AgentCard]]:
    """The SDK's client for `helper`, from its card (fetched with the same key)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(headers=headers, timeout=60) as http:
        card = await A2ACardResolver(http, card_url(base)).get_agent_card()
        client = ClientFactory(ClientConfig(streaming=streaming, httpx_client=http)).create(card)
        try:
            yield client, card
        finally:
            await client.close()


def request(text: str, model: str | None = None, context_id: str | None = None,
            immediately: bool = False) -> SendMessageRequest:
    message = new_text_message(text, context_id=context_id, role=Role.ROLE_USER)
    params = SendMessageRequest(message=message)
    params.configuration.return_immediately = immediately
    if model is not None:
        metadata = Struct()
        metadata.update({"cortex": {"options": {"model": model}}})
        params.metadata.CopyFrom(metadata)
    return params


async def collect(stream: AsyncIterator[StreamResponse]) -> list[StreamResponse]:
    return [item async for item in stream]


def text_of(task: Task) -> str:
    return "".join(part.text for artifact in task.artifacts for part in artifact.parts)


async def wait_state(client: Client, task_id: str, state: int, timeout: float = 30) -> Task:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        task = await client.get_task(GetTaskRequest(id=task_id))
        if task.status.state == state or asyncio.get_running_loop().time() > deadline:
            return task
        await asyncio.sleep(0.05)


def test_card_has_what_the_spec_requires(api: harness.Process) -> None:
    async def main() -> AgentCard:
        async with a2a_client(api.url) as (_, card):
            return card

    card = asyncio.run(main())
    assert card.name == AGENT and card.description == "A nested agent that echoes and calculates."
    assert card.version and card.default_input_modes and card.default_output_modes
    assert card.capabilities.streaming and not card.capabilities.push_notifications
    [interface] = card.supported_interfaces
    assert (interface.url, interface.protocol_binding, interface.protocol_version) == \
        (card_url(api.url), "JSONRPC", "1.0")
    skills = {skill.id: skill for skill in card.skills}
    assert set(skills) == {"helper", "tool:echo", "tool:calculator"}
    assert all(skill.name and skill.description and skill.tags for skill in card.skills)
    assert not card.security_schemes  # no keys configured
    assert httpx.get(f"{card_url(api.url, 'nobody')}/.well-known/agent-card.json").status_code \
        == 404


def test_send_message_blocks_until_the_task_ends(api: harness.Process,
                                                 fake_llm: FakeLLM) -> None:
    model = unique("a2a-send")
    fake_llm.script(model, [turn(final("forty-two"))])

    async def main() -> list[StreamResponse]:
        async with a2a_client(api.url) as (client, _):
            return await collect(client.send_message(request("the answer?", model)))

    [answer] = asyncio.run(main())
    task = answer.task
    assert task.status.state == TaskState.TASK_STATE_COMPLETED
    assert text_of(task) == "forty-two" and task.status.message.parts[0].text == "forty-two"
    assert task.history[0].role == Role.ROLE_USER and task.history[0].parts[0].text == "the answer?"
    job = httpx.get(f"{api.url}/v1/jobs/{task.id}", timeout=10).json()  # the task IS the job
    assert (job["status"], job["agent"]) == ("completed", AGENT)
    session = httpx.get(f"{api.url}/v1/sessions/{task.context_id}", timeout=10).json()
    assert session["jobs"] == [task.id]  # the context IS a session
    assert fake_llm.remaining(model) == 0


def test_streaming_follows_the_job_and_get_task_reads_it(api: harness.Process,
                                                         fake_llm: FakeLLM) -> None:
    model = unique("a2a-stream")
    fake_llm.script(model, [turn('<response final="false">on it</response>', delay_s=1),
                            turn(final("done streaming"))])

    async def main() -> tuple[list[StreamResponse], Task]:
        async with a2a_client(api.url, streaming=True) as (client, _):
            events = await collect(client.send_message(request("stream it", model)))
            task = await client.get_task(GetTaskRequest(id=events[0].task.id, history_length=0))
            return events, task

    events, task = asyncio.run(main())
    first = events[0].task
    assert first.status.state in (TaskState.TASK_STATE_SUBMITTED, TaskState.TASK_STATE_WORKING)
    kinds = [event.WhichOneof("payload") for event in events]
    assert kinds[0] == "task" and set(kinds[1:]) == {"status_update", "artifact_update"}
    statuses = [e.status_update.status for e in events if e.HasField("status_update")]
    assert [s.message.parts[0].text for s in statuses if s.message.parts] == ["on it",
                                                                             "done streaming"]
    assert {s.state for s in statuses[:-1]} == {TaskState.TASK_STATE_WORKING}
    assert statuses[-1].state == TaskState.TASK_STATE_COMPLETED
    [artifact] = [e.artifact_update for e in events if e.HasField("artifact_update")]
    assert artifact.artifact.parts[0].text == "done streaming" and artifact.last_chunk
    assert all(e.task_id == first.id for e in (artifact, *[x.status_update for x in events[1:]
                                                           if x.HasField("status_update")]))
    assert task.status.state == TaskState.TASK_STATE_COMPLETED and text_of(task) == "done streaming"
    assert not task.history  # historyLength 0


def test_context_id_continues_the_session(api: harness.Process, fake_llm: FakeLLM) -> None:
    model = unique("a2a-context")
    fake_llm.script(model, [turn(final("first")), turn(final("second"))])

    async def main() -> tuple[Task, Task]:
        async with a2a_client(api.url) as (client, _):
            [one] = await collect(client.send_message(request("one", model)))
            [two] = await collect(client.send_message(
                request("two", context_id=one.task.context_id)))
            return one.task, two.task

    one, two = asyncio.run(main())
    assert one.context_id == two.context_id and one.id != two.id
    assert text_of(two) == "second"
    second_prompt = fake_llm.requests(model)[1]["messages"]
    assert [m["content"] for m in second_prompt if m["role"] == "user"][-2:] == ["one", "two"]


def test_cancel_and_subscribe_to_a_running_task(api: harness.Process, fake_llm: FakeLLM) -> None:
    model = unique("a2a-cancel")
    fake_llm.script(model, [turn(final("too late"), delay_s=20)])

    async def main() -> tuple[Task, list[StreamResponse], Task]:
        async with a2a_client(api.url) as (client, _), \
                a2a_client(api.url, streaming=True) as (streaming, _):
            [submitted] = await collect(client.send_message(
                request("take your time", model, immediately=True)))  # non-blocking
            task_id = submitted.task.id
            assert submitted.task.status.state in (TaskState.TASK_STATE_SUBMITTED,
                                                   TaskState.TASK_STATE_WORKING)
            await wait_state(client, task_id, TaskState.TASK_STATE_WORKING)
            subscription = asyncio.create_task(
                collect(streaming.subscribe(SubscribeToTaskRequest(id=task_id))))
            await asyncio.sleep(0.5)
            cancelled = await client.cancel_task(CancelTaskRequest(id=task_id))
            events = await asyncio.wait_for(subscription, 30)
            return cancelled, events, await client.get_task(GetTaskRequest(id=task_id))

    cancelled, events, task = asyncio.run(main())
    assert cancelled.status.state == TaskState.TASK_STATE_CANCELED
    assert events[0].task.status.state == TaskState.TASK_STATE_WORKING
    assert events[-1].status_update.status.state == TaskState.TASK_STATE_CANCELED
    assert task.status.state == TaskState.TASK_STATE_CANCELED

    async def again() -> None:
        async with a2a_client(api.url, streaming=True) as (client, _):
            with pytest.raises(UnsupportedOperationError):  # a task that ended: nothing to follow
                await collect(client.subscribe(SubscribeToTaskRequest(id=task.id)))

    asyncio.run(again())


def test_version_negotiation(api: harness.Process) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "nope"}}
    url = card_url(api.url)
    current = httpx.post(url, json=body, headers={"A2A-Version": "1.0"}, timeout=10)
    assert current.headers["A2A-Version"] == "1.0"
    assert current.json()["error"]["code"] == -32001  # TaskNotFoundError: the call was served
    for asked in ("0.3", "2.0", None):  # no header means 0.3 (the spec)
        headers = {"A2A-Version": asked} if asked else {}
        answer = httpx.post(url, json=body, headers=headers, timeout=10)
        assert answer.headers["A2A-Version"] == "1.0"
        assert answer.json()["error"]["code"] == -32009, answer.text  # VersionNotSupportedError


def test_keys_and_tenants(keyed_api: harness.Process, workers: Any, fake_llm: FakeLLM) -> None:
    model = unique("a2a-keys")
    fake_llm.script(model, [turn(final("alpha's"))])
    url = card_url(keyed_api.url)
    assert httpx.get(f"{url}/.well-known/agent-card.json").status_code == 401
    no_key = httpx.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "GetTask",
                                   "params": {"id": "x"}}, headers={"A2A-Version": "1.0"})
    assert no_key.status_code == 401 and "Bearer" in no_key.headers["WWW-Authenticate"]

    async def main() -> tuple[AgentCard, Task]:
        async with a2a_client(keyed_api.url, key=ALPHA) as (client, card):
            [answer] = await collect(client.send_message(request("mine", model)))
        async with a2a_client(keyed_api.url, key=BETA) as (other, _):
            with pytest.raises(TaskNotFoundError):  # another tenant's task is not found
                await other.get_task(GetTaskRequest(id=answer.task.id))
            with pytest.raises(TaskNotFoundError):
                await other.cancel_task(CancelTaskRequest(id=answer.task.id))
        return card, answer.task

    card, task = asyncio.run(main())
    assert set(card.security_schemes) == {"bearer", "apiKey"}
    assert card.security_schemes["bearer"].http_auth_security_scheme.scheme == "Bearer"
    assert task.status.state == TaskState.TASK_STATE_COMPLETED and text_of(task) == "alpha's"
