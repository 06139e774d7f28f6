"""Streaming chat completions from an OpenAI-compatible endpoint, over plain httpx.

* `stream_chat(config, messages, tools=)` yields `TextDelta`s as the server sends them, each
  native `ToolCall` (assembled from its fragments) as soon as it is complete (when the next
  call starts, or when the model finishes), and a `Usage` at the end when the server reports
  one.
* Retries: connection errors, timeouts, 408, 429 and 5xx are retried up to `config.max_retries`
  times with exponential backoff (0.25 s base, jitter, `Retry-After` honoured up to 10 s), but
  only while nothing has been yielded. Once the caller has seen a piece, a failure raises
  `ModelError(retryable=True, streamed=<chars>)` and the caller decides (the coordinator
  restarts the turn). Other 4xx raise `ModelError(retryable=False)` with the server's message.
* The generator may be closed early (`gen.close()`): the HTTP response is closed at once.
* `complete(config, messages)` joins a stream (for `type="llm"` actions); `open_stream(...)`
  dispatches to the replay provider when `config.provider == "replay"`.
"""

from __future__ import annotations

import email.utils
import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from cortex_worker.llm.config import ModelConfig
from cortex_worker.llm.replay import replay_stream
from cortex_worker.llm.stream import ModelError, Piece, TextDelta, ToolCall, Usage

__all__ = ["close_shared_client", "complete", "open_stream", "shared_client", "stream_chat"]

BACKOFF_BASE_S = 0.25
MAX_BACKOFF_S = 10.0
RETRYABLE_STATUS = frozenset({408, 429})  # and every 5xx

_client: httpx.Client | None = None
_client_lock = threading.Lock()
_sleep = time.sleep  # tests may replace it


def shared_client() -> httpx.Client:
    """The process-wide HTTP client (thread-safe, created on first use)."""
    global _client
    with _client_lock:
        if _client is None or _client.is_closed:
            _client = httpx.Client(
                limits=httpx.Limits(max_connections=200, max_keepalive_connections=50),
                follow_redirects=False,
            )
        return _client


def close_shared_client() -> None:
    """Close the process-wide client (a new one is created on next use)."""
    global _client
    with _client_lock:
        if _client is not None:
            _client.close()
            _client = None


def _timeout(config: ModelConfig) -> httpx.Timeout:
    return httpx.Timeout(connect=10.0, read=config.timeout_s, write=30.0, pool=10.0)


def _request_body(config: ModelConfig, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None, *, stream: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {"model": config.model, "messages": messages, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if config.temperature is not None:
        body["temperature"] = config.temperature
    if config.max_tokens is not None:
        body["max_tokens"] = config.max_tokens
    if tools:
        body["tools"] = tools
    return body


def _headers(config: ModelConfig) -> dict[str, str]:
    headers = {"Accept": "text/event-stream", "Content-Type": "application/json"}
    key = config.api_key()
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return headers


# -- errors --------------------------------------------------------------------------------
def _server_message(response: httpx.Response) -> str:
    """The `error.message` of an OpenAI-style error body, else the start of the body."""
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


def _status_error(config: ModelConfig, url: str, response: httpx.Response) -> ModelError:
    status = response.status_code
    message = _server_message(response) or response.reason_phrase or "no message"
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


def _retry_after(response: httpx.Response | None) -> float | None:
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


def _backoff(attempt: int, retry_after: float | None) -> float:
    """Delay before retry number `attempt` (0-based): exponential with jitter, or Retry-After."""
    if retry_after is not None:
        return min(retry_after, MAX_BACKOFF_S) + random.uniform(0, 0.05)
    delay = min(BACKOFF_BASE_S * 2 ** attempt, MAX_BACKOFF_S)
    return random.uniform(delay / 2, delay)


def _attempts(made: int, max_retries: int) -> str:
    """How many requests a failed call made, for its error message."""
    return f"{made} attempt{'s' if made > 1 else ''} made; max_retries is {max_retries}"


def _transport_error(url: str, exc: httpx.HTTPError, config: ModelConfig) -> ModelError:
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


# -- SSE -------------------------------------------------------------------------------------
class _ToolCallBuffer:
    """Accumulates `delta.tool_calls` fragments by index."""

    def __init__(self) -> None:
        self._calls: dict[int, dict[str, Any]] = {}

    def add(self, fragments: list[Any]) -> None:
        for position, fragment in enumerate(fragments):
            if not isinstance(fragment, dict):
                continue
            index = fragment.get("index", position)
            call = self._calls.setdefault(index, {"id": "", "name": "", "arguments": []})
            if fragment.get("id") and not call["id"]:
                call["id"] = str(fragment["id"])
            function = fragment.get("function") or {}
            name = function.get("name")
            if name and name != call["name"]:
                call["name"] += str(name)
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                call["arguments"].append(arguments)
            elif isinstance(arguments, dict):  # some servers send the object itself
                call["arguments"].append(json.dumps(arguments))

    def complete_before(self, fragments: list[Any]) -> list[ToolCall]:
        """The calls these fragments show to be complete: OpenAI streams one call's fragments
        after another, so once a later index starts, every earlier one has all its arguments
        (and can run while the model writes the next)."""
        starts = [f.get("index", position) for position, f in enumerate(fragments)
                  if isinstance(f, dict)]
        if not starts or not all(isinstance(i, int) for i in [*starts, *self._calls]):
            return []
        return self._take([i for i in self._calls if i < min(starts)])

    def flush(self) -> list[ToolCall]:
        return self._take(list(self._calls))  # first-seen order: the index order

    def _take(self, indexes: list[int]) -> list[ToolCall]:
        calls = []
        for index in indexes:
            c = self._calls.pop(index)
            calls.append(ToolCall.from_raw(c["id"] or f"call_{index}", c["name"],
                                           "".join(c["arguments"])))
        return calls


def _sse_data(lines: Iterator[str]) -> Iterator[str]:
    """The `data` of each server-sent event (multi-line data joined with newlines)."""
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def _parse_stream(url: str, lines: Iterator[str]) -> Iterator[Piece]:
    """Pieces from the SSE lines of a chat.completion.chunk stream."""
    calls = _ToolCallBuffer()
    finished = False
    try:
        for data in _sse_data(lines):
            if data.strip() == "[DONE]":
                finished = True
                break
            try:
                chunk = json.loads(data)
            except ValueError:
                raise ModelError(f"model endpoint {url} sent an event that is not JSON: "
                                 f"{data[:200]!r}", retryable=True) from None
            if not isinstance(chunk, dict):
                continue
            if chunk.get("error"):
                error = chunk["error"]
                message = error.get("message", error) if isinstance(error, dict) else error
                raise ModelError(f"model endpoint {url} reported an error mid-stream: {message}",
                                 retryable=True)
            for choice in chunk.get("choices") or []:
                if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                    continue
                delta = choice.get("delta") or {}
                content = delta.get("content")
                if content:
                    yield TextDelta(content)
                if delta.get("tool_calls"):
                    yield from calls.complete_before(delta["tool_calls"])
                    calls.add(delta["tool_calls"])
                if choice.get("finish_reason"):
                    finished = True
                    yield from calls.flush()
            usage = _usage(chunk.get("usage"))
            if usage:
                yield usage
    except httpx.HTTPError:
        if not finished:
            raise
        # The completion was whole (finish_reason seen); only the trailer (usage) is lost.
    if not finished:
        raise ModelError(f"model endpoint {url} ended the stream before the completion finished "
                         "(no finish_reason and no [DONE])", retryable=True)
    yield from calls.flush()


def _usage(data: Any) -> Usage | None:
    if not isinstance(data, dict):
        return None
    prompt = int(data.get("prompt_tokens") or 0)
    completion = int(data.get("completion_tokens") or 0)
    return Usage(prompt, completion, int(data.get("total_tokens") or prompt + completion))


def _parse_whole(url: str, raw: bytes) -> Iterator[Piece]:
    """Pieces from a non-streamed `chat.completion` (some servers ignore `stream: true`)."""
    try:
        data = json.loads(raw)
        message = data["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ModelError(f"model endpoint {url} answered JSON that is not a chat completion: "
                         f"{raw[:200]!r}", retryable=True) from None
    if message.get("content"):
        yield TextDelta(str(message["content"]))
    calls = _ToolCallBuffer()
    calls.add(message.get("tool_calls") or [])
    yield from calls.flush()
    usage = _usage(data.get("usage"))
    if usage:
        yield usage


# -- public API --------------------------------------------------------------------------------
def stream_chat(
    config: ModelConfig,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    client: httpx.Client | None = None,
) -> Iterator[Piece]:
    """Stream one chat completion: `TextDelta`s, then complete `ToolCall`s, then `Usage`.

    Raises `ModelError`. Closing the generator closes the HTTP response.
    """
    try:
        url = f"{config.url()}/chat/completions"
    except ValueError as exc:
        raise ModelError(str(exc)) from None
    http = client or shared_client()
    body = _request_body(config, messages, tools)
    headers = _headers(config)
    timeout = _timeout(config)
    streamed = 0  # characters of text yielded
    yielded = False  # any piece yielded: from then on, no retry
    attempt = 0
    while True:
        response: httpx.Response | None = None
        try:
            with http.stream("POST", url, json=body, headers=headers, timeout=timeout) as response:
                if response.status_code >= 300:
                    response.read()
                    raise _status_error(config, url, response)
                if response.headers.get("content-type", "").startswith("application/json"):
                    pieces = _parse_whole(url, response.read())  # a server that ignores stream
                else:
                    pieces = _parse_stream(url, response.iter_lines())
                for piece in pieces:
                    yielded = True
                    if isinstance(piece, TextDelta):
                        streamed += len(piece.text)
                    yield piece
            return
        except ModelError as exc:
            error = exc
        except httpx.HTTPError as exc:
            error = _transport_error(url, exc, config)
        error.streamed, error.attempts = streamed, attempt + 1
        if not error.retryable or yielded or attempt >= config.max_retries:
            if error.retryable and not yielded:  # a 4xx is final: its count says nothing
                error.message += f" ({_attempts(attempt + 1, config.max_retries)})"
                error.args = (error.message,)
            raise error
        _sleep(_backoff(attempt, _retry_after(response) if error.status else None))
        attempt += 1


def open_stream(
    config: ModelConfig,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    client: httpx.Client | None = None,
    base_dir: str | Path | None = None,
) -> Iterator[Piece]:
    """A stream from the configured provider: the endpoint, or a replayed transcript.

    `base_dir` (the manifests directory) is where a relative replay transcript may live.
    """
    if config.provider == "replay":
        return replay_stream(config, messages, base_dir=base_dir)
    return stream_chat(config, messages, tools=tools, client=client)


def complete(
    config: ModelConfig,
    messages: list[dict[str, Any]],
    *,
    client: httpx.Client | None = None,
    base_dir: str | Path | None = None,
) -> tuple[str, Usage | None]:
    """The whole text of one completion and its usage (for `type="llm"` actions).

    Nothing is shown to anyone until the end, so a stream that fails midway is simply
    retried instead of being reported. Every request, whether it failed before the first
    byte or midway, counts against one budget of `config.max_retries` retries.
    """
    used = 0  # requests made so far
    while True:
        parts: list[str] = []
        usage: Usage | None = None
        budget = config.model_copy(update={"max_retries": config.max_retries - used})
        try:
            for piece in open_stream(budget, messages, client=client, base_dir=base_dir):
                if isinstance(piece, TextDelta):
                    parts.append(piece.text)
                elif isinstance(piece, Usage):
                    usage = piece
            return "".join(parts), usage
        except ModelError as exc:
            used += exc.attempts  # a clean failure has used the gateway's retries already
            if not (exc.retryable and exc.streamed) or used > config.max_retries:
                raise
        _sleep(_backoff(used - 1, None))
