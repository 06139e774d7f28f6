"""The A2A SDK's `RequestHandler`, implemented over Cortex jobs: no task store of its own.

`SendMessage` starts an agent job as the next message of a session (the `contextId`; a new
session when the message names none), through the same functions as `POST /v1/sessions`;
`GetTask` reads the job record, `CancelTask` cancels the job, and the streams follow the job's
event log through the API's one `EventHub` (replay, then live).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, NoReturn

from a2a.server.context import ServerCallContext
from a2a.server.events.event_queue import Event as A2AEvent
from a2a.server.request_handlers.request_handler import RequestHandler
from a2a.server.tasks.inmemory_task_store import InMemoryTaskStore
from a2a.types.a2a_pb2 import (
    AgentCard,
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetExtendedAgentCardRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTaskPushNotificationConfigsResponse,
    ListTasksRequest,
    ListTasksResponse,
    Message,
    SendMessageRequest,
    SubscribeToTaskRequest,
    Task,
    TaskPushNotificationConfig,
)
from a2a.utils.errors import (
    ExtendedAgentCardNotConfiguredError,
    InvalidParamsError,
    PushNotificationNotSupportedError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from a2a.utils.task import apply_history_length, validate_history_length, validate_page_size
from fastapi import HTTPException
from google.protobuf.json_format import MessageToDict
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from cortex_api.auth import Caller
from cortex_api.models import MessageCreate, SessionCreate
from cortex_api.routes.a2a.tasks import message_text, task_of, updates_of
from cortex_api.routes.sessions import create_session, send_message
from cortex_api.sse import HEARTBEAT_S, PAGE_SIZE, EventHub, is_terminal
from cortex_api.sse import job_events as job_log
from cortex_worker.errors import AlreadySubmitted, SubmitError
from cortex_worker.jobs.lifecycle import Once, cancel_job, resubmitted
from cortex_worker.jobs.options import JobOptions
from cortex_worker.jobs.record import JobRecord
from cortex_worker.settings import Settings
from cortex_worker.store.keys import job_keys
from cortex_worker.store.state import SessionBusy, Store


@dataclass(frozen=True, slots=True)
class Scope:
    """One JSON-RPC request's agent and caller, and the API's shared objects."""

    agent: str
    caller: Caller
    store: Store
    hub: EventHub
    settings: Settings


LIST_SCAN = 5000
"""The newest jobs of the caller that ListTasks reads (as `GET /v1/jobs` scans at most)."""
TASK_FIELDS = ("kind", "tenant", "status", "agent", "input", "session", "result", "error",
               "created_at", "started_at", "finished_at")
"""What `task_of` reads of a job."""


def _no_push() -> NoReturn:
    raise PushNotificationNotSupportedError(
        message="push notifications are not supported: stream (SendStreamingMessage, "
                "SubscribeToTask) or poll (GetTask)")


class JobTasks(RequestHandler):
    """A2A tasks of one agent that are Cortex jobs of the caller's tenant."""

    def __init__(self, scope: Scope) -> None:
        self.scope = scope

    # -- reading -------------------------------------------------------------------------
    async def _job(self, task_id: str) -> JobRecord:
        """The caller's job of this agent; another tenant's, another agent's or an expired one
        is not found (the same answer, so ids cannot be probed)."""
        job = await run_in_threadpool(self.scope.store.get_job, task_id) if task_id else None
        if job is None or job.kind != "agent" or job.agent != self.scope.agent \
                or not self.scope.caller.owns(job.tenant):
            raise TaskNotFoundError(message=f"task {task_id!r} not found")
        return job

    async def _follow(self, job_id: str, after: int) -> AsyncIterator[dict[str, Any]]:
        """The job's events after seq `after`, up to its last (the API's SSE machinery)."""
        async with aclosing(job_log(self.scope.hub, job_id, after, HEARTBEAT_S,
                                    PAGE_SIZE)) as items:
            async for item in items:
                if not isinstance(item, str):  # str: a comment for SSE clients
                    yield item

    async def _last_seq(self, job_id: str) -> int:
        entries = await self.scope.hub.redis.xrevrange(job_keys(job_id).events, count=1)
        return int(entries[0][0].split("-")[0]) if entries else 0

    async def _updates(self, job_id: str, context_id: str, after: int
                       ) -> AsyncIterator[A2AEvent]:
        async for event in self._follow(job_id, after):
            for update in updates_of(job_id, context_id, event):
                yield update

    # -- starting ------------------------------------------------------------------------
    async def _submit(self, params: SendMessageRequest) -> JobRecord:
        """Start the job that answers `params.message`: the next message of its context."""
        validate_history_length(params.configuration)
        message: Message = params.message
        text = message_text(message)
        if message.task_id:
            job = await self._job(message.task_id)
            raise UnsupportedOperationError(
                message=f"task {job.id!r} is {job.status}: a Cortex task answers one message; "
                        f"send the next one without taskId, in its context "
                        f"(contextId {task_of(job).context_id!r})")
        try:
            options = JobOptions.model_validate(
                MessageToDict(params.metadata).get("cortex", {}).get("options", {}))
            body = MessageCreate(content=text)
        except ValidationError as exc:
            raise InvalidParamsError(message=f"metadata.cortex.options or message: {exc}") from None
        # a message sent again (same messageId: a client's retry) finds the task it started
        once = Once.of(f"a2a:{self.scope.agent}:{message.message_id}", {
            "contextId": message.context_id, "text": text,
            "options": options.model_dump(mode="json")}) if message.message_id else None
        try:
            job_id = await run_in_threadpool(self._start, message.context_id, body, options,
                                             once)
        except SubmitError as exc:  # e.g. its messageId sent before with another message
            raise InvalidParamsError(message=exc.message) from None
        return await self._job(job_id)

    def _start(self, context_id: str, body: MessageCreate, options: JobOptions,
               once: Once | None) -> str:
        """A new session of this agent, or the caller's session `context_id` of it, gets the
        message: `POST /v1/sessions` and `POST /v1/sessions/{id}/messages` do the work. A
        message `once` started a task already gets that task (and opens no session)."""
        scope = self.scope
        if once is not None:
            found = resubmitted(scope.store, once, scope.caller.tenant)
            if found is not None:
                return found
        if context_id:
            session = scope.store.get_session(context_id)
            if session is None or session.get("agent") != scope.agent \
                    or not scope.caller.owns(session.get("tenant")):
                raise InvalidParamsError(message=f"contextId {context_id!r}: no such context "
                                                 f"of agent {scope.agent!r}")
        else:
            context_id = create_session(SessionCreate(agent=scope.agent, options=options),
                                        scope.store, scope.settings, scope.caller).id
        try:
            return send_message(context_id, body, scope.store, scope.caller, once).id
        except AlreadySubmitted as exc:  # sent again meanwhile
            return exc.job_id
        except SessionBusy as exc:
            raise UnsupportedOperationError(
                message=f"contextId {context_id!r} is busy: its task {exc.job_id!r} is still "
                        "running (wait for it, or cancel it)") from None
        except HTTPException:  # the session expired between the two reads
            raise InvalidParamsError(message=f"contextId {context_id!r}: no such context") \
                from None

    # -- the methods -----------------------------------------------------------------------
    async def on_message_send(self, params: SendMessageRequest,
                              context: ServerCallContext) -> Task | Message:
        """Blocking unless `returnImmediately`: the task once it has ended."""
        job = await self._submit(params)
        if not params.configuration.return_immediately:
            async for event in self._follow(job.id, 0):
                if is_terminal(event):
                    break
            job = await self._job(job.id)
        return apply_history_length(task_of(job), params.configuration)

    async def on_message_send_stream(self, params: SendMessageRequest,
                                     context: ServerCallContext) -> AsyncIterator[A2AEvent]:
        """The task as it is once started, then its updates until it ends."""
        job = await self._submit(params)
        after = await self._last_seq(job.id)  # read before the record: nothing falls between
        task = task_of(await self._job(job.id))
        yield apply_history_length(task, params.configuration)
        async for update in self._updates(job.id, task.context_id, after):
            yield update

    async def on_subscribe_to_task(self, params: SubscribeToTaskRequest,
                                   context: ServerCallContext) -> AsyncIterator[A2AEvent]:
        """The task as it is now, then its updates until it ends (a task that has ended has
        nothing more to stream: UnsupportedOperationError, as the spec says)."""
        job = await self._job(params.id)
        after = await self._last_seq(job.id)  # read before the record: nothing falls between
        job = await self._job(job.id)
        if job.ended:
            raise UnsupportedOperationError(
                message=f"task {job.id!r} is in a terminal state ({job.status}): GetTask reads it")
        task = task_of(job)
        yield task
        async for update in self._updates(job.id, task.context_id, after):
            yield update

    async def on_get_task(self, params: GetTaskRequest, context: ServerCallContext) -> Task:
        validate_history_length(params)
        return apply_history_length(task_of(await self._job(params.id)), params)

    async def on_cancel_task(self, params: CancelTaskRequest,
                             context: ServerCallContext) -> Task:
        job = await self._job(params.id)
        if job.ended or not await run_in_threadpool(cancel_job, self.scope.store, job.id):
            raise TaskNotCancelableError(message=f"task {job.id!r} has already ended "
                                                 f"({(await self._job(job.id)).status})")
        return task_of(await self._job(job.id))

    async def on_list_tasks(self, params: ListTasksRequest,
                            context: ServerCallContext) -> ListTasksResponse:
        """The caller's tasks of this agent (a context's, with `contextId`), filtered, ordered
        and paged by the SDK's own listing (its in-memory task store: status,
        statusTimestampAfter, newest status first, cursor page tokens), of the newest
        `LIST_SCAN` jobs of the caller."""
        validate_history_length(params)
        if params.HasField("page_size"):
            validate_page_size(params.page_size)
        listing = InMemoryTaskStore(owner_resolver=lambda _: self.scope.agent)
        for job in await run_in_threadpool(self._listed, params.context_id):
            await listing.save(task_of(job), context)
        page = await listing.list(params, context)
        for task in page.tasks:
            if not params.include_artifacts:
                task.ClearField("artifacts")
            task.CopyFrom(apply_history_length(task, params))
        return page

    def _listed(self, context_id: str) -> list[JobRecord]:
        """The jobs of this agent the caller may see: a context's (its session's), or the
        newest `LIST_SCAN` of the caller's tenant (every tenant's without keys)."""
        scope = self.scope
        if context_id:
            session = scope.store.get_session(context_id)
            if session is None or not scope.caller.owns(session.get("tenant")):
                return []
            ids = list(session["jobs"])
        else:
            ids = scope.store.list_jobs(limit=LIST_SCAN, tenant=scope.caller.index)
        return [job for job in scope.store.peek_many(ids, *TASK_FIELDS)
                if job is not None and job.agent == scope.agent
                and scope.caller.owns(job.tenant)]

    async def on_create_task_push_notification_config(
            self, params: TaskPushNotificationConfig,
            context: ServerCallContext) -> TaskPushNotificationConfig:
        _no_push()

    async def on_get_task_push_notification_config(
            self, params: GetTaskPushNotificationConfigRequest,
            context: ServerCallContext) -> TaskPushNotificationConfig:
        _no_push()

    async def on_list_task_push_notification_configs(
            self, params: ListTaskPushNotificationConfigsRequest,
            context: ServerCallContext) -> ListTaskPushNotificationConfigsResponse:
        _no_push()

    async def on_delete_task_push_notification_config(
            self, params: DeleteTaskPushNotificationConfigRequest,
            context: ServerCallContext) -> None:
        _no_push()

    async def on_get_extended_agent_card(self, params: GetExtendedAgentCardRequest,
                                         context: ServerCallContext) -> AgentCard:
        raise ExtendedAgentCardNotConfiguredError(
            message="this agent has no extended card: its card is all there is")

