"""A Python client of the Cortex API: `Client` (blocking) and `AsyncClient` (asyncio).

    from cortex_api.client import Client

    with Client("http://127.0.0.1:8000", api_key=...) as cortex:
        job = cortex.submit_agent("researcher", "What limits parallel speedup?")
        for event in cortex.events(job.id):      # typed, resumed after a dropped connection
            print(event.seq, event.type)
        print(cortex.wait(job.id).result)

Both share the requests (`calls`), the errors (`errors`) and the event stream (`events`);
the response types are the API's own (`cortex_api.models`). See README.md#python-client.
"""

from cortex_api.client.aio import AsyncClient
from cortex_api.client.errors import (
    APIError,
    BadRequest,
    Conflict,
    ConnectionFailed,
    CortexClientError,
    InvalidRequest,
    JobTimeout,
    NotFound,
    PayloadTooLarge,
    ServerError,
    Unauthorized,
    Unavailable,
)
from cortex_api.client.sync import Client
from cortex_api.models import JobCreated, JobList, JobOptions, JobStatusView, JobView
from cortex_worker.protocol.events import (
    TERMINAL_EVENTS,
    ActionStatus,
    Event,
    EventType,
    JobStatus,
)

__all__ = [
    "TERMINAL_EVENTS", "APIError", "ActionStatus", "AsyncClient", "BadRequest", "Client",
    "Conflict", "ConnectionFailed", "CortexClientError", "Event", "EventType", "InvalidRequest",
    "JobCreated", "JobList", "JobOptions", "JobStatus", "JobStatusView", "JobTimeout", "JobView",
    "NotFound", "PayloadTooLarge", "ServerError", "Unauthorized", "Unavailable",
]
