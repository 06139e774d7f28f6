"""A small real A2A 1.0 agent for the tests, built from the official a2a-sdk's server parts
(`DefaultRequestHandler`, an in-memory task store, its JSON-RPC and agent-card routes), served
by uvicorn in a thread on a loopback port.

It answers every message deterministically: the task completes with one text artifact,
`echo: <text>`; a text starting with `fail` fails the task with the message `refused: <text>`.
While `hold()` is on, tasks stay `working` until `release()`. It counts what it was asked:
the messages it received (their ids), and the tasks it was asked to cancel.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Self

import uvicorn
from a2a.helpers.proto_helpers import get_message_text, new_text_part
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events.event_queue_v2 import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types.a2a_pb2 import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    Task,
    TaskState,
    TaskStatus,
)
from a2a.utils.constants import PROTOCOL_VERSION_1_0, TransportProtocol
from starlette.applications import Starlette

LOOPBACK = "127.0.0.1"
CARD_PATH = "/.well-known/agent-card.json"


class Echo(AgentExecutor):
    """The agent: echoes, fails on request, holds tasks open while told to."""

    def __init__(self, server: A2AServer) -> None:
        self.server = server

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.message is not None and context.task_id and context.context_id
        self.server.received(context.message.message_id)
        text = get_message_text(context.message)
        if context.current_task is None:
            await event_queue.enqueue_event(Task(
                id=context.task_id, context_id=context.context_id, history=[context.message],
                status=TaskStatus(state=TaskState.TASK_STATE_SUBMITTED)))
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.start_work()
        await self.server.released()
        if text.startswith("fail"):
            await updater.failed(updater.new_agent_message([new_text_part(f"refused: {text}")]))
            return
        await updater.add_artifact([new_text_part(f"echo: {text}")], name="answer",
                                   last_chunk=True)
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id and context.context_id
        self.server.cancelled(context.task_id)
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()


class A2AServer:
    """The agent's server; a context manager. `card_url` is where its card is."""

    def __init__(self, *, streaming: bool = True) -> None:
        self._sock = socket.socket()
        self._sock.bind((LOOPBACK, 0))
        self.url = f"http://{LOOPBACK}:{self._sock.getsockname()[1]}"
        self.card_url = f"{self.url}{CARD_PATH}"
        card = AgentCard(
            name="echo", description="Echoes what it is sent (a test agent).", version="1.0",
            supported_interfaces=[AgentInterface(url=f"{self.url}/rpc",
                                                 protocol_binding=TransportProtocol.JSONRPC.value,
                                                 protocol_version=PROTOCOL_VERSION_1_0)],
            capabilities=AgentCapabilities(streaming=streaming),
            default_input_modes=["text/plain"], default_output_modes=["text/plain"],
            skills=[AgentSkill(id="echo", name="echo", description="echoes", tags=["test"])])
        handler = DefaultRequestHandler(Echo(self), InMemoryTaskStore(), card)
        app = Starlette(routes=[*create_agent_card_routes(card),
                                *create_jsonrpc_routes(handler, "/rpc")])
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="a2a-server", daemon=True)
        self._lock = threading.Lock()
        self._messages: list[str] = []
        self._cancels: list[str] = []
        self._open = threading.Event()
        self._open.set()

    def received(self, message_id: str) -> None:
        with self._lock:
            self._messages.append(message_id)

    def cancelled(self, task_id: str) -> None:
        with self._lock:
            self._cancels.append(task_id)

    @property
    def messages(self) -> list[str]:
        """The ids of the messages received, in order (each started a task)."""
        with self._lock:
            return list(self._messages)

    @property
    def cancels(self) -> list[str]:
        """The tasks a CancelTask was received for."""
        with self._lock:
            return list(self._cancels)

    def hold(self) -> None:
        """Tasks started from now on stay `working` until `release()`."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    async def released(self) -> None:
        while not self._open.is_set():
            await asyncio.sleep(0.05)

    def __enter__(self) -> Self:
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the A2A test server did not start")
            threading.Event().wait(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self._open.set()
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
