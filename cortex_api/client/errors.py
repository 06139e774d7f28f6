"""The client's errors: one tree under `CortexError`, built from the API's error body.

    CortexError
    └── CortexClientError            anything the client raises on purpose
        ├── ConnectionFailed         the API cannot be reached (or a stream kept dropping)
        ├── JobTimeout (TimeoutError)   `wait`/`events` ran past their `timeout`
        └── APIError                 the API answered an error: status, message, detail
            ├── BadRequest           400
            ├── Unauthorized         401: a key is missing or wrong
            ├── NotFound (LookupError)   404: unknown, expired, or another tenant's
            ├── Conflict             409: e.g. cancelling a job that has ended
            ├── PayloadTooLarge      413
            ├── InvalidRequest (ValueError)  422: `errors` lists every problem
            └── ServerError          5xx
                └── Unavailable      502, 503, 504: worth retrying
"""

from __future__ import annotations

from typing import Any

import httpx

from cortex_worker.errors import CortexError


class CortexClientError(CortexError):
    """Anything `Client` and `AsyncClient` raise on purpose; `message` says what went wrong."""


class ConnectionFailed(CortexClientError):
    """The API could not be reached, or an event stream dropped too often without progress."""


class JobTimeout(CortexClientError, TimeoutError):
    """The job did not end within the `timeout` given to `wait` or `events`."""


class APIError(CortexClientError):
    """The API answered with an error. `message` is the API's own sentence; `detail` is the
    whole `detail` object of its body, with fields such as `errors`, `known` or `status`."""

    def __init__(self, message: str, status: int, detail: dict[str, Any]) -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail

    @property
    def errors(self) -> list[dict[str, Any]]:
        """Every problem the API listed (a rejected document's, or a body's schema errors)."""
        errors = self.detail.get("errors")
        return errors if isinstance(errors, list) else []

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status}, {self.message!r})"


class BadRequest(APIError):
    """400: e.g. a `Last-Event-ID` that is not a seq."""


class Unauthorized(APIError):
    """401: keys are configured and the request named none, or an unknown one."""


class NotFound(APIError, LookupError):
    """404: no such job (or expired, or another tenant's), agent, tool or route."""


class Conflict(APIError):
    """409: the request does not fit the resource's state (a job that already ended)."""


class PayloadTooLarge(APIError):
    """413: the body or the document in it is over the API's limit."""


class InvalidRequest(APIError, ValueError):
    """422: the body does not validate, or names an agent, workflow or document that cannot run."""


class ServerError(APIError):
    """5xx: the API failed; its message says how."""


class Unavailable(ServerError):
    """502, 503, 504: the API or Redis is down for now; a retry may succeed."""


STATUS_ERRORS: dict[int, type[APIError]] = {
    400: BadRequest, 401: Unauthorized, 404: NotFound, 409: Conflict, 413: PayloadTooLarge,
    422: InvalidRequest, 502: Unavailable, 503: Unavailable, 504: Unavailable,
}


def error_for(response: httpx.Response) -> APIError:
    """The error of a read 4xx/5xx response: the API's `{"detail": {"message": ...}}`, or,
    from something else on the way (a proxy, a route that does not exist), its text."""
    status = response.status_code
    try:
        body = response.json()
    except ValueError:
        body = None
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, dict) and isinstance(detail.get("message"), str):
        message = detail["message"]
    else:
        text = detail if isinstance(detail, str) else response.text.strip()[:300]
        message = f"HTTP {status}: {text or response.reason_phrase}"
        detail = {"message": message}
    cls = STATUS_ERRORS.get(status) or (ServerError if status >= 500 else APIError)
    return cls(message, status, detail)
