"""The requests of the API and how to read their answers, with no I/O.

Each function returns a `Call`: method, path, body and the parser of a successful answer.
`Client` and `AsyncClient` send the same `Call`s, so a route is described once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar
from urllib.parse import quote

import httpx

from cortex_api.client.errors import ConnectionFailed, error_for
from cortex_api.models import (
    ApprovalDecision,
    JobCreate,
    JobCreated,
    JobList,
    JobOptions,
    JobStatusView,
    JobView,
)

if TYPE_CHECKING:
    from cortex_api.routes.registry import AgentView, ModelEndpointView, ToolView

T = TypeVar("T")

DEFAULT_TIMEOUT = 30.0
STREAM_READ_TIMEOUT = 40.0
"""Seconds an event stream may be silent before it counts as dropped: the server sends a
keep-alive comment after 15 s without an event."""


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One request, and how to turn its successful answer's JSON into a `T`."""

    method: str
    path: str
    parse: Callable[[Any], T]
    json: Any = None
    params: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)

    def result(self, response: httpx.Response) -> T:
        """The parsed answer, or the typed error the API answered with."""
        if response.is_error:
            raise error_for(response)
        return self.parse(response.json() if response.content else None)


def http_options(base_url: str, api_key: str | None, headers: Mapping[str, str] | None,
                 timeout: float) -> dict[str, Any]:
    """Keyword arguments of `httpx.Client` and `httpx.AsyncClient`: the URL, the key as the
    API reads it (`Authorization: Bearer`, see cortex_api.auth) and the timeout."""
    sent = dict(headers or {})
    if api_key:
        sent["Authorization"] = f"Bearer {api_key}"
    return {"base_url": base_url.rstrip("/"), "headers": sent, "timeout": timeout}


def unreachable(base_url: str, error: httpx.TransportError) -> ConnectionFailed:
    """What a request that never got an answer raises."""
    return ConnectionFailed(f"cannot reach the Cortex API at {base_url}: "
                            f"{str(error) or type(error).__name__}")


def job_path(job_id: str) -> str:
    """`/v1/jobs/<id>`, the id quoted: a caller's string never changes the route."""
    return f"/v1/jobs/{quote(job_id, safe='')}"


def submit(body: JobCreate, idempotency_key: str | None = None) -> Call[JobCreated]:
    """`POST /v1/jobs`; with `idempotency_key`, sending it again makes no second job."""
    return Call("POST", "/v1/jobs", JobCreated.model_validate,
                json=body.model_dump(mode="json", exclude_none=True),
                headers={"Idempotency-Key": idempotency_key} if idempotency_key else {})


def submit_document(protocol: str, options: JobOptions | None,
                    idempotency_key: str | None = None) -> Call[JobCreated]:
    return submit(JobCreate(protocol=protocol, options=options or JobOptions()), idempotency_key)


def submit_agent(agent: str, input: str, options: JobOptions | None,
                 idempotency_key: str | None = None) -> Call[JobCreated]:
    return submit(JobCreate(agent=agent, input=input, options=options or JobOptions()),
                  idempotency_key)


def submit_workflow(workflow: str, inputs: Mapping[str, Any] | None,
                    options: JobOptions | None,
                    idempotency_key: str | None = None) -> Call[JobCreated]:
    return submit(JobCreate(workflow=workflow, inputs=dict(inputs or {}),
                            options=options or JobOptions()), idempotency_key)


def get_job(job_id: str) -> Call[JobView]:
    return Call("GET", job_path(job_id), JobView.model_validate)


def list_jobs(status: str | None, limit: int, offset: int) -> Call[JobList]:
    params: dict[str, Any] = {"limit": limit, "offset": offset}
    if status is not None:
        params["status"] = str(status)
    return Call("GET", "/v1/jobs", JobList.model_validate, params=params)


def cancel(job_id: str) -> Call[JobStatusView]:
    return Call("POST", f"{job_path(job_id)}/cancel", JobStatusView.model_validate)


def answer(job_id: str, action_id: str, verdict: str,
           reason: str | None) -> Call[ApprovalDecision]:
    """`approve` or `reject` an action that awaits approval."""
    return Call("POST", f"{job_path(job_id)}/actions/{quote(action_id, safe='')}/{verdict}",
                ApprovalDecision.model_validate, json={"reason": reason})


def list_agents() -> Call[list[AgentView]]:
    return Call("GET", "/v1/agents", _agents)


def list_tools() -> Call[list[ToolView]]:
    return Call("GET", "/v1/tools", _tools)


def list_models() -> Call[list[ModelEndpointView]]:
    return Call("GET", "/v1/models", _models)


# The registry's views live with its routes, which import FastAPI and Celery: imported when
# first needed, so that a program (or the CLI) using the client starts without them.
def _agents(body: Any) -> list[AgentView]:
    from cortex_api.routes.registry import AgentList

    return AgentList.model_validate(body).items


def _tools(body: Any) -> list[ToolView]:
    from cortex_api.routes.registry import ToolList

    return ToolList.model_validate(body).items


def _models(body: Any) -> list[ModelEndpointView]:
    from cortex_api.routes.registry import ModelList

    return ModelList.model_validate(body).items
