"""FastAPI dependencies: the process-wide objects the lifespan puts on `app.state`, and the
request headers more than one route reads."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from cortex_api.readiness import ReadinessProbe
from cortex_api.sse import EventHub
from cortex_worker.settings import Settings
from cortex_worker.store.state import Store


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_store(request: Request) -> Store:
    return request.app.state.store


async def get_hub(request: Request) -> EventHub:
    return request.app.state.hub


async def get_readiness(request: Request) -> ReadinessProbe:
    return request.app.state.readiness


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[Store, Depends(get_store)]
HubDep = Annotated[EventHub, Depends(get_hub)]
ReadinessDep = Annotated[ReadinessProbe, Depends(get_readiness)]

IdempotencyKey = Annotated[str | None, Header(
    alias="Idempotency-Key", min_length=1, max_length=255,
    description="Send the request again with the same key (after a timeout, a lost answer) "
                "and get the job the first one made: nothing is made twice while that job is "
                "kept. The same key with another request is a 422")]
REPLAYED = "Idempotent-Replayed"
"""The answer's header when an `Idempotency-Key` found the job its first request made."""
