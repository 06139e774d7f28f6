"""Error responses: every 4xx/5xx body is `{"detail": {"message": ..., ...}}`.

`install_handlers(app)` registers every exception handler of the API. Routes let the errors
of the `CortexError` tree (see `cortex_worker.errors`) propagate: `cortex_error` answers them
with the status `STATUS` gives their nearest class, and any other error of the tree with a
500. A route raises `api_error(...)` only for what it decides itself (a job's 404, a 409, ...).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.requests import Request

from cortex_api.limits import invalid_unicode
from cortex_worker.errors import CortexError, QuotaExceededError, SubmitError
from cortex_worker.manifests.loader import UnknownAgentError, UnknownWorkflowError
from cortex_worker.store.connect import describe
from cortex_worker.store.state import SessionBusy

log = logging.getLogger(__name__)


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


REDIS_RETRY_AFTER_S = 5
"""What a 503 for Redis asks the client to wait before it tries again: about a failover."""


async def redis_unavailable(request: Request, exc: Exception) -> JSONResponse:
    """503 when Redis cannot take the request (the job state lives there): unreachable, or
    read-only (a replica: the old master after a failover, or a URL naming a replica). The
    store's retries come first, so an unreachable Redis answers after its retry window."""
    if isinstance(exc, ReadOnlyError):
        message = f"Redis is read-only (a replica): {exc}"
    else:
        message = f"Redis is unavailable: {describe(exc)}"
    log.warning("%s %s: %s", request.method, request.url.path, message)
    return JSONResponse({"detail": {"message": message}}, status_code=503,
                        headers={"Retry-After": str(REDIS_RETRY_AFTER_S)})


REDIS_ERRORS: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError,
                                             ReadOnlyError)


async def invalid_request(request: Request, exc: Exception) -> JSONResponse:
    """422 for a body or query that does not validate, in the same shape as every error."""
    assert isinstance(exc, RequestValidationError)
    errors = [{"location": ".".join(str(p) for p in err.get("loc", ())),
               "message": err.get("msg", ""), "type": err.get("type", "")}
              for err in exc.errors()]
    first = errors[0] if errors else {"location": "", "message": "invalid request"}
    where = f" ({first['location']})" if first["location"] else ""
    return JSONResponse({"detail": {"message": f"invalid request{where}: {first['message']}",
                                    "errors": errors}}, status_code=422)


STATUS: dict[type[CortexError], int] = {
    SubmitError: 422,  # the document or the workflow's inputs have errors: `errors` lists them
    UnknownAgentError: 422,  # the body names an agent no manifest declares
    UnknownWorkflowError: 422,  # the body names a workflow no manifest declares
    SessionBusy: 409,  # the session's last job is running, or another message started one
    QuotaExceededError: 429,  # the tenant's token budget is spent until it renews
}
"""The status of each error of the tree the API answers; any other `CortexError` (a broken
manifest, ...) is the server's fault: 500, with the message, and logged."""


def status_of(error: type[CortexError]) -> int:
    """The status `cortex_error` answers `error` with: its nearest class in `STATUS`, else 500."""
    return next((STATUS[cls] for cls in error.__mro__ if cls in STATUS), 500)


def submitting(request: Request, what: str) -> None:
    """Name what `request` submits ("document", "workflow"); a SubmitError then answers
    `the <what> was rejected: ...` (a document by default)."""
    request.state.submitting = what


def rejection(exc: SubmitError, what: str = "document") -> str:
    """The message of a rejected submission: a document's first error with its position and
    how many more there are; a workflow's own summary (its errors name inputs, not lines)."""
    errors = exc.errors or []
    if what != "document" or not errors:
        return f"the {what} was rejected: {exc.message}"
    first = errors[0]
    where = f"line {first.get('line')}, column {first.get('column')}: " if "line" in first else ""
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"the document was rejected: {where}{first.get('message', exc)}{more}"


async def cortex_error(request: Request, exc: Exception) -> JSONResponse:
    """Any `CortexError` a route lets through, as `{"detail": {"message": ...}}` with the
    status of `STATUS`; a SubmitError's body also has its `errors`."""
    assert isinstance(exc, CortexError)
    status = status_of(type(exc))
    detail: dict[str, Any]
    if isinstance(exc, SubmitError):
        what = getattr(request.state, "submitting", "document")
        detail = {"message": rejection(exc, what), "errors": exc.errors}
    else:
        detail = {"message": exc.message}
    if status >= 500:
        log.error("%s %s failed: %s", request.method, request.url.path, exc.message,
                  exc_info=exc)
    return JSONResponse({"detail": detail}, status_code=status)


def install_handlers(app: FastAPI) -> None:
    """Register the API's exception handlers: the one place errors become HTTP responses."""
    app.add_exception_handler(CortexError, cortex_error)
    for error in REDIS_ERRORS:
        app.add_exception_handler(error, redis_unavailable)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(UnicodeEncodeError, invalid_unicode)  # "\ud800" in JSON
