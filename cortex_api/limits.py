"""Size limits: the request body (ASGI middleware) and the document inside it."""

from __future__ import annotations

from fastapi import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cortex_worker.settings import Settings

BODY_OVERHEAD = 64 * 1024  # room for JSON escaping and the other fields around a document


def body_limit(settings: Settings) -> int:
    """The largest request body accepted: a maximal document plus some envelope."""
    return settings.max_document_bytes + BODY_OVERHEAD


class BodyTooLarge(HTTPException):
    """Raised while reading a body that goes over the limit (FastAPI re-raises HTTPExceptions)."""

    def __init__(self, limit: int) -> None:
        super().__init__(status_code=413, detail={
            "message": f"request body too large: the limit is {limit} bytes "
                       f"(set by CORTEX_MAX_DOCUMENT_BYTES plus {BODY_OVERHEAD} bytes)",
            "limit": limit})


class BodyLimitMiddleware:
    """Reject bodies over `max_bytes`: by Content-Length up front, and by counting while read."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            await _reject(BodyTooLarge(self.max_bytes), scope, receive, send)
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge as exc:
            if started:
                raise
            await _reject(exc, scope, receive, send)


def check_document_size(text: str, settings: Settings) -> None:
    """413 if a protocol document is over `max_document_bytes`; 422 if it is not valid Unicode
    (JSON can carry a lone surrogate, `"\\ud800"`, which no UTF-8 encoder accepts)."""
    try:
        size = len(text.encode())
    except UnicodeEncodeError as exc:
        raise HTTPException(status_code=422, detail={
            "message": f"protocol document is not valid Unicode: {exc.reason} at character "
                       f"{exc.start} (a lone surrogate such as \\ud800 in the JSON string)",
            "errors": [{"kind": "invalid_unicode", "message": exc.reason,
                        "line": text.count("\n", 0, exc.start) + 1,
                        "column": exc.start - text.rfind("\n", 0, exc.start)}]}) from None
    if size > settings.max_document_bytes:
        raise HTTPException(status_code=413, detail={
            "message": f"protocol document is {size} bytes; the limit is "
                       f"{settings.max_document_bytes} (CORTEX_MAX_DOCUMENT_BYTES)",
            "limit": settings.max_document_bytes, "size": size})


async def invalid_unicode(request: Request, exc: Exception) -> JSONResponse:
    """422 for a string the body smuggled in that cannot be encoded (a lone surrogate escape
    such as `"\\ud800"` is valid JSON but not Unicode: Redis and every encoder refuse it)."""
    reason = exc.reason if isinstance(exc, UnicodeEncodeError) else str(exc)
    return JSONResponse({"detail": {
        "message": f"invalid request: a string in the body is not valid Unicode ({reason}; "
                   "a lone surrogate such as \\ud800?)"}}, status_code=422)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _reject(exc: BodyTooLarge, scope: Scope, receive: Receive, send: Send) -> None:
    response = JSONResponse({"detail": exc.detail}, status_code=exc.status_code,
                            headers={"Connection": "close"})
    await response(scope, receive, send)
