"""What every HTTP model provider shares: the client, errors, retries.

* `shared_client()` / `close_shared_client()`: one process-wide `httpx.Client` (over
  `http11.Http11Transport` unless the environment names a proxy).
* `stream_with_retries(config, url, body=, headers=, decoder=, whole=, take=)`: POST `body`,
  read the answer with the provider's `sse.Decoder` (one server-sent event at a time; on the
  process's reader thread, `reader.py`, when it can follow the connection) and give each piece
  to `take`; yield what `take` hands back. Connection errors, timeouts, 408,
  429 and 5xx (Anthropic's 529 "overloaded" included) are retried up to `config.max_retries`
  times with exponential backoff (0.25 s base, jitter, `Retry-After` honoured up to 10 s), but
  only while nothing has been yielded. Where the endpoint's limits are shared (`limits.slot`:
  a job's request), each attempt first takes a slot, and a 429 or 529 is not a retry: the
  pause it starts holds this request and every other worker's until the provider's reset.
  Once the caller has seen a piece, a failure raises
  `ModelError(retryable=True, streamed=<chars>)` and the caller decides. Other 4xx raise
  `ModelError(retryable=False)` with the server's `error.message`. Closing the generator
  closes the HTTP response.

The OpenAI-compatible gateway (`gateway.py`) and the Anthropic Messages provider
(`anthropic.py`) are both built on it, so their retry rules and error messages are the same.
"""

from __future__ import annotations

import email.utils
import json
import random
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any, Generic

import httpx

from cortex_worker.llm import limits as shared_limits
from cortex_worker.llm.config import ModelConfig
from cortex_worker.llm.http11 import MAX_IDLE, Http11Transport
from cortex_worker.llm.reader import follow
from cortex_worker.llm.sse import Decoder, T, Take, taken
from cortex_worker.llm.stream import ModelError, Piece, TextDelta, Usage

__all__ = [
    "BACKOFF_BASE_S",
    "MAX_BACKOFF_S",
    "RETRYABLE_STATUS",
    "backoff",
    "close_shared_client",
    "model_url",
    "shared_client",
    "stream_with_retries",
]

BACKOFF_BASE_S = 0.25
MAX_BACKOFF_S = 10.0
RETRYABLE_STATUS = frozenset({408, 429})  # and every 5xx (529: Anthropic's "overloaded")


class _Shared:
    """The process-wide client, made on first use (and again after `close_shared_client`)."""

    def __init__(self) -> None:
        self.client: httpx.Client | None = None
        self.lock = threading.Lock()


_shared = _Shared()
_sleep = time.sleep  # tests may replace it


def shared_client() -> httpx.Client:
    """The process-wide HTTP client (thread-safe, created on first use): model streams go
    through `Http11Transport` (far less CPU per token), or through httpx's own transport
    where the environment names a proxy (which only that one honours)."""
    with _shared.lock:
        if _shared.client is None or _shared.client.is_closed:
            proxied = any(urllib.request.getproxies().get(s) for s in ("http", "https", "all"))
            _shared.client = httpx.Client(
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=MAX_IDLE),
                transport=None if proxied else Http11Transport(),
                follow_redirects=False,
            )
        return _shared.client


def close_shared_client() -> None:
    """Close the process-wide client (a new one is created on next use)."""
    with _shared.lock:
        if _shared.client is not None:
            _shared.client.close()
            _shared.client = None


def timeout(config: ModelConfig) -> httpx.Timeout:
    return httpx.Timeout(connect=10.0, read=config.timeout_s, write=30.0, pool=10.0)


def model_url(config: ModelConfig, path: str) -> str:
    """`base_url` (its `${VAR}`s expanded) + `path`; an unset variable is a final ModelError."""
    try:
        return f"{config.url()}{path}"
    except ValueError as exc:
        raise ModelError(str(exc)) from None


def model_key(config: ModelConfig) -> str | None:
    """The API key (`config.api_key`); a missing one is a final ModelError, never retried."""
    try:
        return config.api_key()
    except ValueError as exc:
        raise ModelError(str(exc)) from None


# -- errors --------------------------------------------------------------------------------
def server_message(response: httpx.Response) -> str:
    """The `error.message` of an error body (OpenAI's and Anthropic's shape alike), else the
    start of the body."""
    try:
        text = response.text
    except (httpx.HTTPError, UnicodeDecodeError):
        return ""
    try:
        data = json.loads(text)
    except ValueError:
        return " ".join(text.split())[:500]
    if isinstance(data, dict):
        error = data.get("error", data)
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
    return " ".join(text.split())[:500]


def status_error(config: ModelConfig, url: str, response: httpx.Response) -> ModelError:
    status = response.status_code
    message = server_message(response) or response.reason_phrase or "no message"
    hint = ""
    if status in (401, 403):
        hint = (f" (check the API key in the environment variable {config.api_key_env})"
                if config.api_key_env else " (the endpoint needs an API key: set api_key_env)")
    elif status == 404:
        hint = f" (check base_url {config.base_url!r} and model {config.model!r})"
    elif status < 400:
        where = response.headers.get("location", "elsewhere")
        hint = f" (redirected to {where}; set base_url to the endpoint itself)"
    retryable = status in RETRYABLE_STATUS or status >= 500
    return ModelError(f"model endpoint {url} answered HTTP {status}: {message}{hint}",
                      retryable=retryable, status=status)


def retry_after(response: httpx.Response | None) -> float | None:
    """Seconds asked for by a `Retry-After` header (delay-seconds or HTTP date)."""
    if response is None:
        return None
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def backoff(attempt: int, after: float | None) -> float:
    """Delay before retry number `attempt` (0-based): exponential with jitter, or Retry-After."""
    if after is not None:
        return min(after, MAX_BACKOFF_S) + random.uniform(0, 0.05)
    delay = min(BACKOFF_BASE_S * 2 ** attempt, MAX_BACKOFF_S)
    return random.uniform(delay / 2, delay)


def attempts_note(made: int, max_retries: int) -> str:
    """How many requests a failed call made, for its error message."""
    return f"{made} attempt{'s' if made > 1 else ''} made; max_retries is {max_retries}"


def transport_error(url: str, exc: httpx.HTTPError, config: ModelConfig) -> ModelError:
    if isinstance(exc, httpx.ConnectTimeout):
        what = "timed out connecting"
    elif isinstance(exc, httpx.ReadTimeout):
        what = f"sent nothing for {config.timeout_s:g} s (timeout_s)"
    elif isinstance(exc, httpx.TimeoutException):
        what = f"timed out ({type(exc).__name__})"
    elif isinstance(exc, httpx.ConnectError):
        what = f"could not be reached ({exc}); check base_url and that the server is running"
    elif isinstance(exc, httpx.RemoteProtocolError):
        what = f"closed the connection mid-response ({exc})"
    else:
        what = f"failed: {type(exc).__name__}: {exc}"
    return ModelError(f"model endpoint {url} {what}", retryable=True)


class _Counted(Generic[T]):
    """`take` that counts the pieces it was given and their text (for the retry rules), and
    hands the reported usage to the request's shared slot."""

    __slots__ = ("chars", "held", "pieces", "take")

    def __init__(self, take: Take[T]) -> None:
        self.take, self.pieces, self.chars = take, 0, 0
        self.held: shared_limits.Held | None = None

    def __call__(self, piece: Piece) -> T | None:
        self.pieces += 1
        if isinstance(piece, TextDelta):
            self.chars += len(piece.text)
            if self.held is not None:
                self.held.deltas += 1
        elif isinstance(piece, Usage) and self.held is not None:
            self.held.used(piece)
        return self.take(piece)


# -- the request loop ------------------------------------------------------------------------
def stream_with_retries(
    config: ModelConfig,
    url: str,
    *,
    body: dict[str, Any],
    headers: dict[str, str],
    decoder: Callable[[str], Decoder],
    whole: Callable[[str, bytes], Iterator[Piece]],
    take: Take[T],
    client: httpx.Client | None = None,
) -> Iterator[T]:
    """POST `body` to `url`, give each piece of the answer to `take`, and yield what `take`
    returns (None: nothing), retrying as the module says.

    A streamed answer is read by `decoder(url)`, on this process's reader thread when the
    connection is one it can follow (`reader.follow`); a JSON answer (a server that ignores
    `stream`) by `whole(url, body)`. A 3xx is an error (redirects are not followed: base_url
    should name the endpoint).
    """
    http = client or shared_client()
    limits = timeout(config)
    counted = _Counted(take)  # once it has seen a piece, no retry
    attempt = 0
    while True:
        response: httpx.Response | None = None
        refused = False  # by the provider's rate limit, with a shared slot: waited out, not retried
        try:
            with shared_limits.slot(config, body) as held, \
                    http.stream("POST", url, json=body, headers=headers,
                                timeout=limits) as response:
                counted.held = held
                if held is not None:
                    held.answered(response)
                    refused = held.refused
                if response.status_code >= 300:
                    response.read()
                    raise status_error(config, url, response)
                if response.headers.get("content-type", "").startswith("application/json"):
                    yield from taken(whole(url, response.read()), counted)
                else:
                    yield from follow(response, decoder(url), counted)
            return
        except ModelError as exc:
            error = exc
        except httpx.HTTPError as exc:
            error = transport_error(url, exc, config)
        error.streamed, error.attempts = counted.chars, attempt + 1
        if refused and not counted.pieces:
            continue  # the slot's pause holds this request (and every other) until the reset
        if not error.retryable or counted.pieces or attempt >= config.max_retries:
            if error.retryable and not counted.pieces:  # a 4xx is final: its count says nothing
                error.message += f" ({attempts_note(attempt + 1, config.max_retries)})"
                error.args = (error.message,)
            raise error
        _sleep(backoff(attempt, retry_after(response) if error.status else None))
        attempt += 1
