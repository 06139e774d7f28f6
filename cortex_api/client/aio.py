"""`AsyncClient`: `Client` for asyncio programs, on the same calls, errors and event stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from cortex_api.client import calls
from cortex_api.client.errors import Unavailable, error_for
from cortex_api.client.events import EventStream
from cortex_api.models import (
    ApprovalDecision,
    JobCreated,
    JobList,
    JobOptions,
    JobStatusView,
    JobView,
)
from cortex_worker.protocol.events import Event

if TYPE_CHECKING:
    from cortex_api.routes.registry import AgentView, ModelEndpointView, ToolView

T = TypeVar("T")


class AsyncClient:
    """`Client`, awaitable: every method does what the `Client` method of that name does.
    Close it with `aclose()`, or use it in an `async with` block."""

    def __init__(self, base_url: str, api_key: str | None = None, *,
                 headers: Mapping[str, str] | None = None,
                 timeout: float = calls.DEFAULT_TIMEOUT,
                 stream_timeout: float = calls.STREAM_READ_TIMEOUT) -> None:
        options = calls.http_options(base_url, api_key, headers, timeout)
        self.base_url: str = options["base_url"]
        self.headers: dict[str, str] = options["headers"]
        self.stream_timeout = stream_timeout
        self._http = httpx.AsyncClient(**options)

    # -- jobs -----------------------------------------------------------------------------
    async def submit_document(self, protocol: str, *, options: JobOptions | None = None,
                              idempotency_key: str | None = None) -> JobCreated:
        return await self._send(calls.submit_document(protocol, options, idempotency_key))

    async def submit_agent(self, agent: str, input: str, *, options: JobOptions | None = None,
                           idempotency_key: str | None = None) -> JobCreated:
        return await self._send(calls.submit_agent(agent, input, options, idempotency_key))

    async def submit_workflow(self, workflow: str, inputs: Mapping[str, Any] | None = None, *,
                              options: JobOptions | None = None,
                              idempotency_key: str | None = None) -> JobCreated:
        return await self._send(calls.submit_workflow(workflow, inputs, options,
                                                      idempotency_key))

    async def get_job(self, job_id: str) -> JobView:
        return await self._send(calls.get_job(job_id))

    async def list_jobs(self, *, status: str | None = None, limit: int = 50,
                        offset: int = 0) -> JobList:
        return await self._send(calls.list_jobs(status, limit, offset))

    async def cancel(self, job_id: str) -> JobStatusView:
        return await self._send(calls.cancel(job_id))

    async def approve(self, job_id: str, action_id: str) -> ApprovalDecision:
        return await self._send(calls.answer(job_id, action_id, "approve", None))

    async def reject(self, job_id: str, action_id: str,
                     reason: str | None = None) -> ApprovalDecision:
        return await self._send(calls.answer(job_id, action_id, "reject", reason))

    async def events(self, job_id: str, *, after: int = 0,
                     timeout: float | None = None) -> AsyncIterator[Event]:
        """See `Client.events`. Leaving the loop early? `aclose()` the iterator to close
        the connection at once."""
        stream = EventStream(job_id, after, timeout)
        while not stream.done:
            try:
                async with self._http.stream(
                        "GET", stream.path, headers=stream.headers(),
                        timeout=stream.read_timeout(self.stream_timeout)) as response:
                    if response.is_error:
                        await response.aread()
                        raise error_for(response)
                    decoder = stream.connected()
                    async for line in response.aiter_lines():
                        event = stream.receive(decoder, line)
                        if event is not None:
                            yield event
                            if stream.done:
                                return
                stream.closed()
            except (httpx.TransportError, Unavailable) as exc:
                await asyncio.sleep(stream.dropped(exc))

    async def wait(self, job_id: str, *, timeout: float | None = None) -> JobView:
        async for _ in self.events(job_id, timeout=timeout):
            pass
        return await self.get_job(job_id)

    # -- registry -------------------------------------------------------------------------
    async def list_agents(self) -> list[AgentView]:
        return await self._send(calls.list_agents())

    async def list_tools(self) -> list[ToolView]:
        return await self._send(calls.list_tools())

    async def list_models(self) -> list[ModelEndpointView]:
        return await self._send(calls.list_models())

    # -- plumbing -------------------------------------------------------------------------
    async def _send(self, call: calls.Call[T]) -> T:
        try:
            response = await self._http.request(call.method, call.path, json=call.json,
                                                params=call.params, headers=call.headers)
        except httpx.TransportError as exc:
            raise calls.unreachable(self.base_url, exc) from exc
        return call.result(response)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        traceback: TracebackType | None) -> None:
        await self.aclose()
