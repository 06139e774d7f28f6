"""`Client`: the Cortex API from blocking code (the CLI's live views use it)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
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


class Client:
    """A Cortex API at `base_url`; `api_key` is sent as `Authorization: Bearer` (needed when
    the API has keys: the key decides the tenant). Close it, or use it in a `with` block."""

    def __init__(self, base_url: str, api_key: str | None = None, *,
                 headers: Mapping[str, str] | None = None,
                 timeout: float = calls.DEFAULT_TIMEOUT,
                 stream_timeout: float = calls.STREAM_READ_TIMEOUT) -> None:
        options = calls.http_options(base_url, api_key, headers, timeout)
        self.base_url: str = options["base_url"]
        self.headers: dict[str, str] = options["headers"]
        self.stream_timeout = stream_timeout
        self._http = httpx.Client(**options)

    # -- jobs -----------------------------------------------------------------------------
    def submit_document(self, protocol: str, *, options: JobOptions | None = None,
                        idempotency_key: str | None = None) -> JobCreated:
        """Queue a protocol document; `InvalidRequest.errors` lists what stops it running.
        With `idempotency_key`, a call repeated with it (after a timeout or a lost answer)
        gets the job the first made: nothing is made twice."""
        return self._send(calls.submit_document(protocol, options, idempotency_key))

    def submit_agent(self, agent: str, input: str, *, options: JobOptions | None = None,
                     idempotency_key: str | None = None) -> JobCreated:
        """Queue a job of `agent` on the task `input` (`idempotency_key`: as above)."""
        return self._send(calls.submit_agent(agent, input, options, idempotency_key))

    def submit_workflow(self, workflow: str, inputs: Mapping[str, Any] | None = None, *,
                        options: JobOptions | None = None,
                        idempotency_key: str | None = None) -> JobCreated:
        """Queue a job of `workflow` on `inputs` (`idempotency_key`: as above)."""
        return self._send(calls.submit_workflow(workflow, inputs, options, idempotency_key))

    def get_job(self, job_id: str) -> JobView:
        """The job with its actions and their outcomes."""
        return self._send(calls.get_job(job_id))

    def list_jobs(self, *, status: str | None = None, limit: int = 50,
                  offset: int = 0) -> JobList:
        """A page of the caller's jobs, newest first; pass `next_offset` on for the next."""
        return self._send(calls.list_jobs(status, limit, offset))

    def cancel(self, job_id: str) -> JobStatusView:
        """Cancel the job; `Conflict` if it had already ended (`detail["status"]` says how)."""
        return self._send(calls.cancel(job_id))

    def approve(self, job_id: str, action_id: str) -> ApprovalDecision:
        """Let an action that awaits approval run."""
        return self._send(calls.answer(job_id, action_id, "approve", None))

    def reject(self, job_id: str, action_id: str, reason: str | None = None) -> ApprovalDecision:
        """Refuse an action that awaits approval; the model sees it fail with `reason`."""
        return self._send(calls.answer(job_id, action_id, "reject", reason))

    def events(self, job_id: str, *, after: int = 0,
               timeout: float | None = None) -> Iterator[Event]:
        """The job's events after seq `after`, replayed then live, until its last one. A
        dropped connection is resumed with `Last-Event-ID`: no event is lost or repeated.
        `JobTimeout` after `timeout` seconds; `ConnectionFailed` if the API stays away."""
        stream = EventStream(job_id, after, timeout)
        while not stream.done:
            try:
                with self._http.stream("GET", stream.path, headers=stream.headers(),
                                       timeout=stream.read_timeout(self.stream_timeout)) as response:
                    if response.is_error:
                        response.read()
                        raise error_for(response)
                    decoder = stream.connected()
                    for line in response.iter_lines():
                        event = stream.receive(decoder, line)
                        if event is not None:
                            yield event
                            if stream.done:
                                return
                stream.closed()
            except (httpx.TransportError, Unavailable) as exc:
                time.sleep(stream.dropped(exc))

    def wait(self, job_id: str, *, timeout: float | None = None) -> JobView:
        """The job once it has ended (whichever way: check `status`); `JobTimeout` after
        `timeout` seconds."""
        for _ in self.events(job_id, timeout=timeout):
            pass
        return self.get_job(job_id)

    # -- registry -------------------------------------------------------------------------
    def list_agents(self) -> list[AgentView]:
        """The agents of the API's manifests, by name."""
        return self._send(calls.list_agents())

    def list_tools(self) -> list[ToolView]:
        """The tools the API knows (built-in and declared), by name."""
        return self._send(calls.list_tools())

    def list_models(self) -> list[ModelEndpointView]:
        """The model endpoints (`kind: Model`, and inline blocks with limits), by name, with
        their limits and live use across the cluster."""
        return self._send(calls.list_models())

    # -- plumbing -------------------------------------------------------------------------
    def _send(self, call: calls.Call[T]) -> T:
        try:
            response = self._http.request(call.method, call.path, json=call.json,
                                          params=call.params, headers=call.headers)
        except httpx.TransportError as exc:
            raise calls.unreachable(self.base_url, exc) from exc
        return call.result(response)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
