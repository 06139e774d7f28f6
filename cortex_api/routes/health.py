"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from cortex_api.deps import ReadinessDep
from cortex_api.models import HealthStatus, Readiness

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthStatus)
async def healthz() -> HealthStatus:
    """The process is up (checks nothing else)."""
    return HealthStatus()


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
async def readyz(probe: ReadinessDep) -> JSONResponse:
    """200 if Redis answers and every required pool has a worker, else 503 (cached ~2 s)."""
    result = await probe.check()
    return JSONResponse(result.model_dump(), status_code=200 if result.status == "ready" else 503)
