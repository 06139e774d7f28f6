"""MCP at `/mcp`: each agent of the registry is a tool of a Streamable HTTP MCP server.

A thin adapter over jobs, never a second engine: a `tools/call` submits the agent's job (or a
session's next message) exactly as `POST /v1/jobs` (or `POST /v1/sessions/{id}/messages`)
would, reports the job's events as progress notifications while it runs, and answers with its
end. The protocol is the official `mcp` SDK's low-level `Server` behind its
`StreamableHTTPSessionManager`, stateless (every request stands alone, so any API replica
serves it); this module only authenticates the request and maps agents, jobs and events.
See docs/integrations.md#mcp.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Annotated, Any, Literal

import anyio
from fastapi import FastAPI, HTTPException
from fastapi.security import HTTPBearer
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.shared.exceptions import MCPError
from mcp_types import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    CallToolRequestParams,
    CallToolResult,
    ListToolsResult,
    PaginatedRequestParams,
    TextContent,
    Tool,
)
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.json_schema import SkipJsonSchema
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from cortex_api.auth import Caller, caller
from cortex_api.models import MessageCreate
from cortex_api.routes import sessions
from cortex_api.sse import EventHub, is_terminal, job_events
from cortex_worker.errors import CortexError
from cortex_worker.handles import get_registry
from cortex_worker.jobs.lifecycle import submit_agent
from cortex_worker.protocol.events import EventType
from cortex_worker.store.state import Store, dumps

PATH = "/mcp"
#: Where the request's `Caller` waits for the tool handler (`scope["state"]`).
CALLER_STATE = "cortex_mcp_caller"
INSTRUCTIONS = ("Each tool is a Cortex agent: the call runs it as a job on `input` and answers "
                "with its final response. Pass `session_id` (a session of that agent, "
                "`POST /v1/sessions`) to continue a conversation.")

_bearer = HTTPBearer(auto_error=False)


class AgentCall(BaseModel):
    """A tool's arguments: what the agent is asked, and optionally the session it continues."""

    model_config = ConfigDict(extra="forbid")

    input: str = Field(min_length=1, max_length=200_000,
                       description="the message for the agent")
    session_id: Annotated[str, Field(
        min_length=1, description="a session of this agent (`POST /v1/sessions`): the message "
                                  "continues its conversation")] | SkipJsonSchema[None] = Field(
        default=None, json_schema_extra=lambda schema: schema.pop("default"))


class AgentOutcome(BaseModel):
    """A call's `structuredContent`: the job that ran and how it ended."""

    job_id: str = Field(description="the Cortex job (`GET /v1/jobs/{job_id}`)")
    status: Literal["completed", "failed", "cancelled"]
    result: Any = Field(description="the agent's final response: text, or for an agent with an "
                        "output_schema its value")
    error: str | None = Field(default=None, description="why the job failed or was cancelled")


INPUT_SCHEMA = AgentCall.model_json_schema()
OUTPUT_SCHEMA = AgentOutcome.model_json_schema()


class McpEndpoint:
    """The ASGI app at `/mcp` and the MCP server behind it. Its `run()` belongs in the API's
    lifespan: each run has a session manager of its own (the SDK's runs only once)."""

    def __init__(self, app: FastAPI) -> None:
        self._app = app
        self._server: Server[Any] = Server("cortex", version=app.version, title=app.title,
                                           instructions=INSTRUCTIONS,
                                           on_list_tools=self._list_tools,
                                           on_call_tool=self._call_tool)
        self._manager: StreamableHTTPSessionManager | None = None

    @asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        """Serve `/mcp` while inside."""
        manager = StreamableHTTPSessionManager(self._server, stateless=True)
        async with manager.run():
            self._manager = manager
            try:
                yield
            finally:
                self._manager = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Authenticate as every REST route does (HTTPException: the API's 401), then hand
        the request to the SDK's transport."""
        request = Request(scope)
        credentials = await _bearer(request)
        who = await caller(request, credentials, request.headers.get("x-api-key"))
        if self._manager is None:
            raise HTTPException(503, detail={"message": "the MCP endpoint is not running"})
        scope.setdefault("state", {})[CALLER_STATE] = who
        await self._manager.handle_request(scope, receive, send)

    # -- handlers -------------------------------------------------------------------------
    async def _list_tools(self, ctx: ServerRequestContext[Any],
                          params: PaginatedRequestParams | None) -> ListToolsResult:
        """Every agent, sorted by name: agents are not per tenant (the jobs are)."""
        agents = get_registry().agents
        return ListToolsResult(tools=[
            Tool(name=name, description=agents[name].description or f"the Cortex agent {name}",
                 input_schema=INPUT_SCHEMA, output_schema=OUTPUT_SCHEMA)
            for name in sorted(agents)])

    async def _call_tool(self, ctx: ServerRequestContext[Any],
                         params: CallToolRequestParams) -> CallToolResult:
        """Run the agent as a job and wait for its end; bad arguments, a refused submission
        and a job that did not complete are tool errors (the model reads them)."""
        if params.name not in get_registry().agents:
            raise MCPError(code=INVALID_PARAMS, message=f"Unknown tool: {params.name}")
        try:
            call = AgentCall.model_validate(params.arguments or {})
        except ValidationError as exc:
            return _tool_error("; ".join(_argument_error(error) for error in exc.errors()))
        request: Request = ctx.request  # the POST that carried the call
        who: Caller = request.scope["state"][CALLER_STATE]
        state = self._app.state
        try:
            job_id = await anyio.to_thread.run_sync(_submit, state.store, who, params.name,
                                                    call)
        except HTTPException as exc:
            return _tool_error(exc.detail["message"] if isinstance(exc.detail, dict)
                               else str(exc.detail))
        except CortexError as exc:
            return _tool_error(str(exc))
        end = await _follow(ctx, state.hub, job_id)
        return _outcome(job_id, end)


def mount(app: FastAPI) -> McpEndpoint:
    """Add `/mcp` to `app`; enter the returned endpoint's `run()` in the app's lifespan."""
    endpoint = McpEndpoint(app)
    app.add_route(PATH, endpoint, include_in_schema=False)
    return endpoint


# -- jobs ---------------------------------------------------------------------------------
def _submit(store: Store, who: Caller, agent: str, call: AgentCall) -> str:
    """The job's id: a new job of `agent`, or the session's next message (the sessions
    route's own code, so its checks apply: the tenant's, and one message at a time)."""
    if call.session_id is None:
        return submit_agent(store, agent, call.input, tenant=who.tenant)
    data = store.get_session(call.session_id)
    if data is None or not who.owns(data.get("tenant")):
        raise CortexError(f"session_id: no session {call.session_id!r}")
    if data["agent"] != agent:
        raise CortexError(f"session_id: session {call.session_id!r} is a conversation with "
                          f"agent {data['agent']!r}, not {agent!r}")
    return sessions.send_message(call.session_id, MessageCreate(content=call.input), store,
                                 who).id


async def _events(hub: EventHub, job_id: str) -> AsyncIterator[dict[str, Any]]:
    """The job's events until its last, through the one follow of the SSE routes (replay,
    live, Redis outages ridden out); comments for SSE clients skipped."""
    async with aclosing(job_events(hub, job_id)) as items:
        async for item in items:
            if not isinstance(item, str):
                yield item


async def _follow(ctx: ServerRequestContext[Any], hub: EventHub,
                  job_id: str) -> dict[str, Any]:
    """The job's last event; each event worth a line on the way is a progress notification
    (progress: its seq), sent only if the client asked for progress."""
    async for event in _events(hub, job_id):
        message = progress_message(job_id, event)
        if message:
            await ctx.session.report_progress(float(event["seq"]), None, message)
        if is_terminal(event):
            return event
    raise MCPError(code=INTERNAL_ERROR,
                   message=f"lost the events of job {job_id} (Redis unavailable); it goes on: "
                           f"GET /v1/jobs/{job_id}")


def progress_message(job_id: str, event: dict[str, Any]) -> str | None:
    """One line for a progress notification, or None for events not worth one (text chunks)."""
    data: dict[str, Any] = event.get("data") or {}
    action = data.get("action_id")
    match event.get("type"):
        case EventType.job_queued:
            return f"job {job_id} queued"
        case EventType.job_started:
            return "job started"
        case EventType.turn_started:
            return f"turn {data.get('turn')}"
        case EventType.action_started:
            return f"action {action} started"
        case EventType.action_completed:
            return f"action {action} completed"
        case EventType.action_failed:
            return f"action {action} failed: {data.get('error')}"
        case EventType.approval_requested:
            return (f"action {action} ({data.get('name')}) awaits approval: "
                    f"POST /v1/jobs/{job_id}/actions/{action}/approve (or /reject)")
        case EventType.job_completed | EventType.job_failed | EventType.job_cancelled:
            return f"job {data.get('status')}"
    return None


def _outcome(job_id: str, end: dict[str, Any]) -> CallToolResult:
    """The tool's answer from the job's last event: its response, or its error."""
    data: dict[str, Any] = end.get("data") or {}
    status = data.get("status") or end["type"].removeprefix("job_")
    error = data.get("error") or data.get("reason") or None
    result = data.get("result")
    outcome = AgentOutcome(job_id=job_id, status=status,
                           result="" if result is None else result, error=error)
    answer = outcome.result if isinstance(outcome.result, str) else dumps(outcome.result)
    text = answer if status == "completed" else f"job {job_id} {status}: {error}"
    return CallToolResult(content=[TextContent(text=text)], is_error=status != "completed",
                          structured_content=outcome.model_dump(mode="json"))


def _tool_error(message: str) -> CallToolResult:
    return CallToolResult(content=[TextContent(text=message)], is_error=True)


def _argument_error(error: Any) -> str:
    """`argument input: Field required`: the argument's name first, as the model must fix it."""
    where = ".".join(str(part) for part in error["loc"]) or "arguments"
    return f"argument {where}: {error['msg']}"
