"""A2A client: Cortex calls a real A2A agent (tests/a2a_server.py, the official a2a-sdk's server
parts) as `<action type="agent" name="remote_echo">` (tests/manifests/remote_agents.yaml).

The stack is its own (Redis, an agent and an llm worker, the API), with the agent server's URL
in `CORTEX_TEST_A2A_URL`: these tests kill the llm worker, which runs the remote calls. Nothing
is asserted about durations: only what the agent server received and what Cortex recorded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cortex_api.client import Client
from cortex_worker.actions.call import idempotency_key
from cortex_worker.actions.table import ACTION_TYPES
from cortex_worker.agents.prompt import build_system_prompt
from cortex_worker.manifests.loader import load_registry
from cortex_worker.protocol.events import Event
from cortex_worker.store.state import Store
from tests import harness
from tests.a2a_server import A2AServer
from tests.manifest_helpers import TEST_MANIFESTS, write


@dataclass
class Stack:
    env: dict[str, str]
    url: str
    store: Store
    log_dir: Path
    llm: harness.Process
    agent: A2AServer
    poller: A2AServer  # its card declares no streaming

    def client(self) -> Client:
        return Client(self.url)


@pytest.fixture(scope="module")
def stack(cortex_env: dict[str, str], harness_dir: Path) -> Iterator[Stack]:
    log_dir = harness_dir / "a2a-client"
    with A2AServer() as agent, A2AServer(streaming=False) as poller, \
            harness.RedisServer(log_dir=log_dir, data_dir=log_dir / "redis") as server:
        env = {**cortex_env, "CORTEX_REDIS_URL": server.url, "CORTEX_TEST_A2A_URL": agent.url,
               "CORTEX_TEST_A2A_POLL_URL": poller.url}
        workers = harness.start_workers({"agent": 2, "llm": 2}, env, log_dir=log_dir,
                                        cwd=log_dir)
        api = harness.start_api(env, log_dir=log_dir, cwd=log_dir)
        store = Store.from_url(server.url)
        running = Stack(env, api.url or "", store, log_dir, workers["llm"], agent, poller)
        try:
            yield running
        finally:
            agent.release()
            harness.stop_all(processes=[api, *workers.values(), running.llm])


def ask(text: str, agent: str = "remote_echo", **fields: object) -> str:
    """A document whose one action `ask` asks the remote agent, and whose response is its
    answer."""
    body = json.dumps({"name": agent, "parameters": {"input": text}, **fields})
    return f'<action type="agent" id="ask">{body}</action>\n<response>$ask</response>'


def of(events: list[Event], kind: str) -> list[Event]:
    return [e for e in events if e.type == kind]


def recorded(stack: Stack, job_id: str) -> dict[str, str]:
    """The remote task the job's action started, once Cortex has recorded it."""
    return harness.wait_until(lambda: stack.store.remote_task(job_id, "ask"), timeout=30)


def test_the_remote_agents_answer_is_the_actions_value(stack: Stack) -> None:
    with stack.client() as client:
        job = client.submit_document(ask("hello")).id
        events = list(client.events(job, timeout=60))
    [done] = of(events, "action_completed")
    assert done.data["result"] == "echo: hello"
    assert events[-1].type == "job_completed"
    task = stack.store.remote_task(job, "ask")
    assert task is not None and task["agent"] == "remote_echo" and task["task_id"]
    assert idempotency_key(job, "ask") in stack.agent.messages  # the message id is the key


def test_an_agent_that_does_not_stream_is_polled(stack: Stack) -> None:
    stack.poller.hold()
    try:
        with stack.client() as client:
            job = client.submit_document(ask("poll me", "remote_poller")).id
            recorded(stack, job)
            stack.poller.release()
            events = list(client.events(job, timeout=60))
    finally:
        stack.poller.release()
    [done] = of(events, "action_completed")
    assert done.data["result"] == "echo: poll me"


def test_a_call_out_of_time_times_out_and_cancels_the_remote_task(stack: Stack) -> None:
    stack.agent.hold()
    try:
        with stack.client() as client:
            job = client.submit_document(ask("too slow", timeout=1)).id
            events = list(client.events(job, timeout=60))
    finally:
        stack.agent.release()
    [failed] = of(events, "action_failed")
    assert failed.data["status"] == "timeout", failed.data
    task = stack.store.remote_task(job, "ask")
    assert task is not None
    harness.wait_until(lambda: task["task_id"] in stack.agent.cancels, timeout=30)


def test_a_failed_remote_task_fails_the_action_with_its_message(stack: Stack) -> None:
    with stack.client() as client:
        job = client.submit_document(ask("fail, please")).id
        events = list(client.events(job, timeout=60))
    [failed] = of(events, "action_failed")
    assert "refused: fail, please" in failed.data["error"], failed.data
    assert "remote agent 'remote_echo'" in failed.data["error"]


def test_a_worker_killed_mid_call_resumes_the_same_remote_task(stack: Stack) -> None:
    """The llm worker is SIGKILLed while the remote task is open; the reconciler sends the
    action again, and the new attempt follows the recorded task: one message was sent."""
    stack.agent.hold()
    seen: list[Event] = []
    with stack.client() as client:
        job = client.submit_document(ask("survive")).id
        stream = iter(client.events(job, timeout=120))

        def until(kind: str, **data: object) -> Event:
            for event in stream:
                seen.append(event)
                if event.type == kind and all(event.data.get(k) == v for k, v in data.items()):
                    return event
            raise AssertionError(f"no {kind} {data} in {[e.type for e in seen]}")

        task = recorded(stack, job)
        stack.llm.kill()
        assert stack.llm.wait_stopped(10), stack.llm.describe()
        stack.llm.stop()
        stack.llm = harness.start_worker("llm", stack.env, 2, log_dir=stack.log_dir,
                                         cwd=stack.log_dir)
        until("action_started", attempt=2)
        stack.agent.release()
        seen.extend(stream)
    assert seen[-1].type == "job_completed", seen[-1]
    [done] = of(seen, "action_completed")
    assert done.data["result"] == "echo: survive"
    assert stack.agent.messages.count(idempotency_key(job, "ask")) == 1
    assert stack.store.remote_task(job, "ask") == task


def test_cancelling_the_job_cancels_the_remote_task(stack: Stack) -> None:
    stack.agent.hold()
    try:
        with stack.client() as client:
            job = client.submit_document(ask("cancel me")).id
            task = recorded(stack, job)
            client.cancel(job)
            harness.wait_until(lambda: task["task_id"] in stack.agent.cancels, timeout=30)
            assert client.wait(job, timeout=60).status == "cancelled"
    finally:
        stack.agent.release()
    assert stack.agent.cancels.count(task["task_id"]) == 1
    assert stack.agent.messages.count(idempotency_key(job, "ask")) == 1


def test_agents_see_remote_agents_in_their_prompt_and_grammar(tmp_path: Path) -> None:
    """An agent's `agents:` may name a remote agent: its prompt lists it with its description,
    and its grammar lets it be called (the action-type table's prompt and callees)."""
    write(tmp_path, "remote_agents.yaml", (TEST_MANIFESTS / "remote_agents.yaml").read_text())
    write(tmp_path, "agent.yaml", """
        kind: Agent
        name: delegator
        agents: [remote_echo]
    """)
    registry = load_registry(tmp_path)
    agent = registry.agent("delegator")
    assert "- remote_echo: Echoes what it is sent, over A2A" in \
        build_system_prompt(agent, registry)
    assert [name for name, _ in ACTION_TYPES["agent"].callees(agent, registry)] == \
        ["remote_echo"]
