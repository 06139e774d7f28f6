"""`type="agent"` actions on a `kind: RemoteAgent`: a call over A2A 1.0 (the official a2a-sdk
client) with Cortex's durability; a local agent's action starts its child job (`agents.action`).

A call sends its message once, without waiting (`returnImmediately`), its message id the
action's idempotency key, and records the remote task id in Redis at once (`Store.
record_remote_task`). It then follows the task (SubscribeToTask where the card declares
streaming, else GetTask) until it ends; GetTask reads its outcome. A later attempt of the
action (its worker was killed: the reconciler sent it again) finds the recorded task and follows
it, never sending again. A call stops when its job ends (or fails, or is cancelled: the remote
task is cancelled too), when its time runs out (cancelled too), or when its attempt turns out
stale (`recovery.fencing`: the attempt that took over follows the same task, so it runs on).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import httpx
from a2a.client import A2ACardResolver, A2AClientError, ClientConfig, ClientFactory
from a2a.client.client import Client
from a2a.helpers.proto_helpers import get_data_parts, get_text_parts, new_text_message
from a2a.types.a2a_pb2 import (
    AgentCard,
    CancelTaskRequest,
    GetTaskRequest,
    Message,
    Part,
    Role,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskState,
)
from a2a.utils.errors import A2AError

from cortex_worker.actions.call import Call, idempotency_key
from cortex_worker.agents import action as local
from cortex_worker.handles import get_registry, get_store
from cortex_worker.manifests.loader import RemoteAgentSpec
from cortex_worker.protocol.events import JOB_TERMINAL
from cortex_worker.recovery import fencing
from cortex_worker.services.mcp.spec import expand
from cortex_worker.store.state import Store, dumps
from cortex_worker.tools.errors import ToolError, ToolTimeout

log = logging.getLogger(__name__)

REQUEST_S = 30.0
"""Each request's own time limit (the call's is the action's timeout)."""
STREAM_S = 30.0
"""A SubscribeToTask stream is read this long at most, then the task is read again (GetTask):
a stream that went quiet without ending cannot hold the call."""
POLL_S = (0.2, 2.0)
"""GetTask polling: the first pause, doubled up to the last."""
WATCH_S = 0.5
"""How often the call looks at its job's status and its attempt's (stale or not)."""
FAILURES = 5
"""Requests in a row that may fail (network, HTTP status) before the call gives up."""

ENDED = frozenset({TaskState.TASK_STATE_COMPLETED, TaskState.TASK_STATE_FAILED,
                   TaskState.TASK_STATE_CANCELED, TaskState.TASK_STATE_REJECTED,
                   TaskState.TASK_STATE_INPUT_REQUIRED, TaskState.TASK_STATE_AUTH_REQUIRED})
"""The states a task stops in: the terminal ones, and those waiting for a person's input,
which a Cortex action cannot give."""

_cards: dict[str, AgentCard] = {}
_cards_lock = threading.Lock()


def run_agent_action(call: Call) -> Any:
    """The runner of `type="agent"`: a remote agent is called; a local one's child job asked
    for."""
    remote = get_registry().remote_agents.get(call.spec["name"])
    if remote is None:
        return local.run_agent_action(call)
    stale = threading.Event()
    held = fencing.current()
    if held is not None:
        held.on_stale(stale.set)
    return asyncio.run(_call(remote, call, get_store(), stale))


@dataclass
class _Remote:
    """One call's clients of the remote agent, and the task it follows once known."""

    spec: RemoteAgentSpec
    client: Client  # SendMessage (not streamed), GetTask, CancelTask
    streaming: Client | None  # SubscribeToTask, if the card declares streaming
    task_id: str | None = None


async def _call(spec: RemoteAgentSpec, call: Call, store: Store, stale: threading.Event) -> Any:
    """The call, raced against what stops it: its job's end, its attempt going stale, its
    time running out."""
    async with httpx.AsyncClient(headers=_headers(spec), timeout=REQUEST_S) as http:
        card = await _card(http, spec)
        remote = _Remote(spec, _client(card, http, streaming=False),
                         _client(card, http, streaming=True) if card.capabilities.streaming
                         else None)
        work = asyncio.ensure_future(_result(remote, call, store))
        watch = asyncio.ensure_future(_watch(store, call.job_id, stale))
        try:
            done, _ = await asyncio.wait({work, watch}, timeout=call.timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            for future in (work, watch):
                future.cancel()
            await asyncio.gather(work, watch, return_exceptions=True)
        if work in done:
            return work.result()
        reason = watch.result() if watch in done else "timeout"
        if reason == "stale":
            raise ToolError(f"remote agent {spec.name!r}: this attempt was taken over; the "
                            "new one follows its task")
        what = f"remote agent {spec.name!r}"
        if remote.task_id is not None:
            await _cancel(remote, remote.task_id)
            what += f" (task {remote.task_id}, cancelled)"
        if reason == "timeout":
            raise ToolTimeout(f"{what} did not answer within {call.timeout:g}s")
        raise ToolError(f"{what}: the job ended ({reason})")


async def _result(remote: _Remote, call: Call, store: Store) -> Any:
    """Send the message (unless an earlier attempt did), record the task, follow it to its
    end: the action's value."""
    recorded = await asyncio.to_thread(store.remote_task, call.job_id, call.action_id)
    task: Task | None = None
    if recorded is None:
        answer = await _send(remote, call)
        if isinstance(answer, Message):  # an answer without a task: nothing to follow
            return _value(answer.parts)
        task = answer
        remote.task_id = task.id  # cancelled if the call stops while it is recorded
        recorded = await asyncio.to_thread(
            store.record_remote_task, call.job_id, call.action_id,
            {"task_id": task.id, "context_id": task.context_id, "agent": remote.spec.name})
        if recorded["task_id"] != task.id:  # a paused attempt sent too, and recorded first
            await _cancel(remote, task.id)
            task = None
    else:
        log.info("job %s: action %s (attempt %d) follows remote task %s of agent %r, sent by "
                 "an earlier attempt", call.job_id, call.action_id, call.attempt,
                 recorded["task_id"], remote.spec.name)
    remote.task_id = str(recorded["task_id"])
    return _outcome(remote.spec, await _follow(remote, remote.task_id, task))


async def _send(remote: _Remote, call: Call) -> Task | Message:
    """SendMessage without waiting for the task to end; the message id is the action's
    idempotency key, the same on every attempt."""
    params = call.params
    text = params["input"] if isinstance(params, dict) and isinstance(params.get("input"), str) \
        else dumps(params)
    message = new_text_message(text, role=Role.ROLE_USER)
    message.message_id = idempotency_key(call.job_id, call.action_id)
    request = SendMessageRequest(message=message)
    request.configuration.return_immediately = True
    try:
        async for response in remote.client.send_message(request):
            return response.task if response.HasField("task") else response.message
    except A2AError as exc:
        raise ToolError(f"remote agent {remote.spec.name!r}: SendMessage failed: "
                        f"{_reason(exc)}") from None
    raise ToolError(f"remote agent {remote.spec.name!r} answered SendMessage with nothing")


async def _follow(remote: _Remote, task_id: str, task: Task | None) -> Task:
    """The task once it stops (`ENDED`): streamed where the agent streams, else polled; each
    wait ends in a GetTask, the one reading of the task's outcome."""
    pause, failures = POLL_S[0], 0
    while task is None or task.status.state not in ENDED:
        if task is not None:
            ended = False
            if remote.streaming is not None:
                ended = await _subscribe(remote.streaming, task_id)
            if not ended:
                await asyncio.sleep(pause)
                pause = min(pause * 2, POLL_S[1])
        try:
            task = await remote.client.get_task(GetTaskRequest(id=task_id, history_length=0))
            failures = 0
        except A2AClientError as exc:  # the network, an HTTP status: the task is still there
            failures += 1
            if failures >= FAILURES:
                raise ToolError(f"remote agent {remote.spec.name!r}: GetTask {task_id} failed "
                                f"{failures} times: {_reason(exc)}") from None
            log.warning("remote agent %r: GetTask %s failed (%s); trying again",
                        remote.spec.name, task_id, _reason(exc))
            task = task or Task(id=task_id)
        except A2AError as exc:  # the agent's answer: no such task, …
            raise ToolError(f"remote agent {remote.spec.name!r}: GetTask {task_id}: "
                            f"{_reason(exc)}") from None
    return task


async def _subscribe(client: Client, task_id: str) -> bool:
    """Wait on the task's stream (at most `STREAM_S`); whether it said the task stopped."""
    try:
        async with asyncio.timeout(STREAM_S):
            async for event in client.subscribe(SubscribeToTaskRequest(id=task_id)):
                if _stopped(event):
                    return True
    except (A2AError, TimeoutError) as exc:  # it had ended already, the stream broke…: GetTask
        log.debug("SubscribeToTask %s ended: %s", task_id, exc)
    return False


def _stopped(event: StreamResponse) -> bool:
    kind = event.WhichOneof("payload")
    if kind == "message":
        return True
    if kind == "task":
        return event.task.status.state in ENDED
    return kind == "status_update" and event.status_update.status.state in ENDED


async def _watch(store: Store, job_id: str, stale: threading.Event) -> str:
    """Why the call must stop: its job's status once the job has ended (or is gone), or
    "stale" once its attempt was taken over (`fencing` set `stale`)."""
    while True:
        job = await asyncio.to_thread(store.peek, job_id, "status")
        if job is None:
            return "expired"
        if job.status in JOB_TERMINAL:
            return str(job.status)
        if stale.is_set():
            return "stale"
        await asyncio.sleep(WATCH_S)


async def _cancel(remote: _Remote, task_id: str) -> None:
    """CancelTask; a task that has ended already, or an agent that cannot, is only logged."""
    try:
        await remote.client.cancel_task(CancelTaskRequest(id=task_id))
        log.info("remote agent %r: task %s cancelled", remote.spec.name, task_id)
    except A2AError as exc:
        log.warning("remote agent %r: CancelTask %s: %s", remote.spec.name, task_id,
                    _reason(exc))


def _outcome(spec: RemoteAgentSpec, task: Task) -> Any:
    """A completed task's value (its artifacts, else its status message); ToolError for the
    other ends, with the agent's message."""
    state = task.status.state
    if state == TaskState.TASK_STATE_COMPLETED:
        parts = [part for artifact in task.artifacts for part in artifact.parts]
        return _value(parts or task.status.message.parts)
    said = "\n".join(get_text_parts(task.status.message.parts))
    what = {TaskState.TASK_STATE_FAILED: "failed", TaskState.TASK_STATE_REJECTED: "rejected it",
            TaskState.TASK_STATE_CANCELED: "cancelled it",
            TaskState.TASK_STATE_INPUT_REQUIRED: "asks for input, which an action cannot give",
            TaskState.TASK_STATE_AUTH_REQUIRED: "asks for authorization, which an action "
                                                "cannot give"}[state]
    raise ToolError(f"remote agent {spec.name!r} (task {task.id}) {what}"
                    + (f": {said}" if said else ""))


def _value(parts: Any) -> Any:
    """Text parts as one string; data parts alone as their value (a list if several)."""
    listed: list[Part] = list(parts)
    texts, data = get_text_parts(listed), get_data_parts(listed)
    if data and not texts:
        return data[0] if len(data) == 1 else data
    return "\n".join(texts)


async def _card(http: httpx.AsyncClient, spec: RemoteAgentSpec) -> AgentCard:
    """The agent's card, fetched once per process (by its URL)."""
    url = expand(spec.card_url, f"remote agent {spec.name!r}: card_url")
    with _cards_lock:
        card = _cards.get(url)
    if card is not None:
        return card
    try:
        card = await A2ACardResolver(http, url, agent_card_path="").get_agent_card()
    except A2AError as exc:
        raise ToolError(f"remote agent {spec.name!r}: cannot read its card at {url}: "
                        f"{_reason(exc)}") from None
    with _cards_lock:
        return _cards.setdefault(url, card)


def _client(card: AgentCard, http: httpx.AsyncClient, *, streaming: bool) -> Client:
    return ClientFactory(ClientConfig(streaming=streaming, httpx_client=http)).create(card)


def _headers(spec: RemoteAgentSpec) -> dict[str, str]:
    """`Authorization: Bearer <token>` from `auth_env`, if the manifest names one."""
    if spec.auth_env is None:
        return {}
    token = os.environ.get(spec.auth_env)
    if not token:
        raise ToolError(f"remote agent {spec.name!r}: environment variable {spec.auth_env!r} "
                        "(auth_env) is not set")
    return {"Authorization": f"Bearer {token}"}


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
