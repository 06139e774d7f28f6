"""Error responses: every 4xx/5xx body is `{"detail": {"message": ..., ...}}`."""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.requests import Request


class ErrorDetail(BaseModel):
    """What went wrong, in a sentence, plus fields that depend on the error."""

    model_config = ConfigDict(extra="allow")

    message: str


class ErrorBody(BaseModel):
    """The body of an error response."""

    detail: ErrorDetail


def api_error(status_code: int, message: str, **extra: Any) -> HTTPException:
    """An HTTPException whose detail is `{"message": message, **extra}`."""
    return HTTPException(status_code=status_code, detail={"message": message, **extra})


def job_not_found(job_id: str) -> HTTPException:
    return api_error(404, f"job {job_id!r} not found (unknown, or expired after its retention period)")


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` entries for error codes that use `ErrorBody`."""
    return {code: {"model": ErrorBody} for code in codes}


async def redis_unavailable(request: Request, exc: Exception) -> JSONResponse:
    """503 when Redis cannot be reached (the job state lives there)."""
    return JSONResponse({"detail": {"message": f"Redis is unavailable: {exc}"}}, status_code=503)


REDIS_ERRORS: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError)


async def invalid_request(request: Request, exc: Exception) -> JSONResponse:
    """422 for a body or query that does not validate, in the same shape as every error."""
    from fastapi.exceptions import RequestValidationError

    assert isinstance(exc, RequestValidationError)
    errors = [{"location": ".".join(str(p) for p in err.get("loc", ())),
               "message": err.get("msg", ""), "type": err.get("type", "")}
              for err in exc.errors()]
    first = errors[0] if errors else {"location": "", "message": "invalid request"}
    where = f" ({first['location']})" if first["location"] else ""
    return JSONResponse({"detail": {"message": f"invalid request{where}: {first['message']}",
                                    "errors": errors}}, status_code=422)
