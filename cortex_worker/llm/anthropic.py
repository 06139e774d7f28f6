"""Anthropic's Messages API, streamed, over plain httpx: `provider: anthropic`.

`stream_messages(config, messages, tools=)` takes the coordinator's OpenAI-style conversation
and tools, sends `POST {base_url}/messages` (`base_url` ends in `/v1`, as for OpenAI:
`https://api.anthropic.com/v1`) with `stream: true`, and yields the same pieces as the
OpenAI-compatible gateway:

* `TextDelta` for each `text_delta`, as it arrives (thinking blocks are not protocol text and
  are skipped);
* a `ToolCall` for each `tool_use` block at its `content_block_stop`, its `input_json_delta`
  fragments joined, so a call runs while the model writes the next one. Tools are sent with
  `eager_input_streaming: true` (fine-grained tool streaming: the input is streamed as the
  model writes it, without the server buffering and validating it), so a block may hold
  partial or invalid JSON: that becomes `ToolCall(arguments=None, raw_arguments=<text>)`,
  which the coordinator reports back to the model as a precise protocol error;
* a `Usage` last: prompt tokens are `input_tokens` plus the cache tokens
  (`cache_creation_input_tokens`, `cache_read_input_tokens`), completion tokens are
  `output_tokens` (from `message_start`, updated by `message_delta`).

Conversion (`to_messages_request`): system messages become the top-level `system`; an
assistant's `tool_calls` become `tool_use` blocks (`input` = the parsed arguments; arguments
that were not a JSON object are kept as `{"INVALID_JSON": "<text>"}`, as Anthropic suggests);
consecutive `tool` messages become one user message of `tool_result` blocks, in call order,
with `is_error: true` when the content starts with an error status (`error: ...`,
`timeout: ...`, see `jobs.turns.loop._tool_content`); a user message that follows joins that same
user message after the results. Empty text is left out (the API refuses empty text blocks)
and messages of the same role in a row are merged. Tools become `{name, description,
input_schema}`. `max_tokens` is required by the API: `config.max_tokens`, else
`DEFAULT_MAX_TOKENS`.

Retries and errors are the gateway's (`transport.stream_with_retries`): connection errors,
timeouts, 408, 429, 5xx and 529 (overloaded) are retried with backoff and `Retry-After` while
nothing has been yielded; other 4xx raise `ModelError(retryable=False)` with the API's
`error.message`. An `error` event mid-stream (`overloaded_error`, `api_error`...) is retryable
unless its type is a client error (`invalid_request_error`...).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import httpx

from cortex_worker.llm import transport
from cortex_worker.llm.config import ModelConfig, function_name
from cortex_worker.llm.sse import T, Take, hand_over, json_event
from cortex_worker.llm.stream import ModelError, Piece, TextDelta, ToolCall, Usage

__all__ = [
    "API_VERSION",
    "DEFAULT_MAX_TOKENS",
    "ERROR_STATUSES",
    "stream_messages",
    "to_messages_request",
]

API_VERSION = "2023-06-01"
"""The `anthropic-version` header."""
DEFAULT_MAX_TOKENS = 8192
"""`max_tokens` when the config sets none (the API requires one; every current model can
write this many)."""
ERROR_STATUSES = ("error", "timeout", "skipped", "cancelled")
"""The result statuses other than `ok`: a `tool` message starting with `<status>: ` is the
error of its call (`jobs.turns.loop._tool_content`), sent with `is_error: true`."""

#: The HTTP status of each error type of an `error` event (Anthropic's error types).
_ERROR_TYPES = {
    "invalid_request_error": 400, "authentication_error": 401, "billing_error": 402,
    "permission_error": 403, "not_found_error": 404, "request_too_large": 413,
    "rate_limit_error": 429, "api_error": 500, "timeout_error": 504, "overloaded_error": 529,
}
_USAGE_KEYS = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens",
               "output_tokens")


# -- conversion --------------------------------------------------------------------------------
def _unsupported(what: str) -> ModelError:
    return ModelError(f"model provider 'anthropic' cannot send {what}")


def _text_blocks(content: Any) -> list[dict[str, Any]]:
    """Text blocks of an OpenAI `content` (a string, or a list of `text` parts)."""
    if content is None:
        return []
    if isinstance(content, str):
        parts = [content]
    elif isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text") or ""))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _unsupported(f"message content of type {kind!r} (only text)")
    else:
        parts = [str(content)]
    return [{"type": "text", "text": text} for text in parts if text.strip()]


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, dict):
        arguments_input = arguments
    elif not isinstance(arguments, str) or not arguments.strip():
        arguments_input = {}
    else:
        try:
            value = json.loads(arguments)
        except (ValueError, RecursionError):
            value = None
        arguments_input = value if isinstance(value, dict) else {"INVALID_JSON": arguments}
    return {"type": "tool_use", "id": str(call.get("id") or ""),
            "name": str(function.get("name") or ""), "input": arguments_input}


def _tool_result(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    text = content if isinstance(content, str) else \
        "".join(b["text"] for b in _text_blocks(content))
    block: dict[str, Any] = {"type": "tool_result",
                             "tool_use_id": str(message.get("tool_call_id") or "")}
    if text:
        block["content"] = text
    if any(text.startswith(f"{status}: ") for status in ERROR_STATUSES):
        block["is_error"] = True
    return block


def _tools(tools: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not function.get("name"):
            raise _unsupported(f"the tool {tool!r} (expected an OpenAI function spec)")
        spec: dict[str, Any] = {"name": function["name"]}
        if function.get("description"):
            spec["description"] = function["description"]
        spec["input_schema"] = function.get("parameters") or {"type": "object", "properties": {}}
        spec["eager_input_streaming"] = True  # fine-grained tool streaming
        out.append(spec)
    return out


def to_messages_request(messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The `system`, `messages` and `tools` of a Messages API request for an OpenAI-style
    conversation (see the module's docstring). Raises `ModelError` on what it cannot send."""
    system: list[str] = []
    out: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if not blocks:
            return
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": blocks})

    for message in messages:
        role = message.get("role")
        if role in ("system", "developer"):
            system.extend(b["text"] for b in _text_blocks(message.get("content")))
        elif role == "user":
            add("user", _text_blocks(message.get("content")))
        elif role == "assistant":
            add("assistant", [*_text_blocks(message.get("content")),
                              *(_tool_use(c) for c in message.get("tool_calls") or [])])
        elif role == "tool":
            add("user", [_tool_result(message)])
        else:
            raise _unsupported(f"a message with role {role!r}")
    request: dict[str, Any] = {}
    if system:
        request["system"] = "\n\n".join(system)
    request["messages"] = out
    if tools:
        request["tools"] = _tools(tools)
    return request


ANTHROPIC_TOOL_CHOICE = {"auto": "auto", "required": "any", "none": "none"}
"""`ModelConfig.tool_choice` (OpenAI's words) as the Messages API's `tool_choice.type`; a tool's
name is `{"type": "tool", "name": ...}`."""


STRUCTURED_OUTPUTS_BETA = "structured-outputs-2025-11-13"
"""The `anthropic-beta` value under which the Messages API takes `output_format`."""


def _request_body(config: ModelConfig, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None,
                  output_schema: Mapping[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": config.model,
                            "max_tokens": config.max_tokens or DEFAULT_MAX_TOKENS}
    body.update(to_messages_request(messages, tools))
    forced = config.forced_tool
    if tools and forced is not None:
        body["tool_choice"] = {"type": "tool", "name": function_name(forced)}
    elif tools and config.tool_choice != "auto":
        body["tool_choice"] = {"type": ANTHROPIC_TOOL_CHOICE[config.tool_choice]}
    if output_schema is not None:  # a text answer is this JSON (structured outputs, beta)
        body["output_format"] = {"type": "json_schema", "schema": dict(output_schema)}
    if config.temperature is not None:
        body["temperature"] = config.temperature
    body["stream"] = True
    return body


def _headers(config: ModelConfig) -> dict[str, str]:
    headers = {"accept": "text/event-stream", "content-type": "application/json",
               "anthropic-version": API_VERSION}
    key = transport.model_key(config)
    if key:
        headers["x-api-key"] = key
    return headers


# -- the stream --------------------------------------------------------------------------------
class _Usage:
    """Token counts from `message_start`, updated by each `message_delta` (cumulative)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def update(self, data: Any) -> None:
        if isinstance(data, dict):
            for key in _USAGE_KEYS:
                if isinstance(data.get(key), int):
                    self.counts[key] = data[key]

    def piece(self) -> Usage | None:
        if not self.counts:
            return None
        prompt = sum(self.counts.get(k, 0) for k in _USAGE_KEYS[:3])
        completion = self.counts.get("output_tokens", 0)
        return Usage(prompt, completion, prompt + completion)


def _tool_call(index: Any, block: dict[str, Any]) -> ToolCall:
    raw = "".join(block["parts"])
    if not block["parts"] and isinstance(block["input"], dict) and block["input"]:
        raw = json.dumps(block["input"])  # a server that sends the input whole at the start
    return ToolCall.from_raw(block["id"] or f"toolu_{index}", block["name"], raw)


def _stream_error(url: str, error: Any) -> ModelError:
    kind = error.get("type") if isinstance(error, dict) else None
    message = error.get("message", error) if isinstance(error, dict) else error
    status = _ERROR_TYPES.get(str(kind))
    retryable = status is None or status in transport.RETRYABLE_STATUS or status >= 500
    return ModelError(f"model endpoint {url} reported an error mid-stream: "
                      f"{kind + ': ' if kind else ''}{message}", retryable=retryable,
                      status=status)


class MessagesDecoder:
    """The pieces of a Messages stream, one server-sent event at a time
    (`transport.Decoder`)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.tool_blocks: dict[Any, dict[str, Any]] = {}  # block index -> tool_use being written
        self.usage = _Usage()
        self.finished = False  # the message's stop_reason (message_delta) or message_stop
        self.done = False  # message_stop

    def event(self, name: str, data: str) -> list[Piece]:
        payload = json_event(self.url, data)
        if payload is None:
            return []
        kind = payload.get("type", name)
        if kind == "content_block_delta":
            delta = payload.get("delta") or {}
            if delta.get("type") == "text_delta" and delta.get("text"):
                return [TextDelta(str(delta["text"]))]
            if delta.get("type") == "input_json_delta":
                tool = self.tool_blocks.get(payload.get("index"))
                if tool is not None and isinstance(delta.get("partial_json"), str):
                    tool["parts"].append(delta["partial_json"])
            # thinking, signature and citations deltas are not protocol text
        elif kind == "message_start":
            self.usage.update((payload.get("message") or {}).get("usage"))
        elif kind == "content_block_start":
            block = payload.get("content_block") or {}
            if block.get("type") == "tool_use":
                self.tool_blocks[payload.get("index")] = {
                    "id": str(block.get("id") or ""), "name": str(block.get("name") or ""),
                    "input": block.get("input"), "parts": []}
            elif block.get("type") == "text" and block.get("text"):
                return [TextDelta(str(block["text"]))]
        elif kind == "content_block_stop":
            index = payload.get("index")
            if index in self.tool_blocks:
                return [_tool_call(index, self.tool_blocks.pop(index))]
        elif kind == "message_delta":
            self.usage.update(payload.get("usage"))
            if (payload.get("delta") or {}).get("stop_reason"):
                self.finished = True
        elif kind == "message_stop":
            self.finished = self.done = True
        elif kind == "error":
            raise _stream_error(self.url, payload.get("error"))
        # `ping` and event types added later are ignored, as Anthropic asks
        return []

    def end(self) -> list[Piece]:
        if not self.finished:
            raise ModelError(f"model endpoint {self.url} ended the stream before the message "
                             "finished (no stop_reason and no message_stop)", retryable=True)
        pieces: list[Piece] = [_tool_call(index, self.tool_blocks.pop(index))
                               for index in list(self.tool_blocks)]  # cut by max_tokens
        usage = self.usage.piece()
        if usage:
            pieces.append(usage)
        return pieces


def _parse_whole(url: str, raw: bytes) -> Iterator[Piece]:
    """Pieces from a non-streamed `message` (a compatible server that ignores `stream`)."""
    try:
        data = json.loads(raw)
        content = data["content"]
        if not isinstance(content, list):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise ModelError(f"model endpoint {url} answered JSON that is not a message: "
                         f"{raw[:200]!r}", retryable=True) from None
    for index, block in enumerate(content):
        if not isinstance(block, dict):
            continue
        if block.get("type") == "text" and block.get("text"):
            yield TextDelta(str(block["text"]))
        elif block.get("type") == "tool_use":
            yield _tool_call(index, {"id": str(block.get("id") or ""),
                                     "name": str(block.get("name") or ""),
                                     "input": block.get("input"), "parts": []})
    usage = _Usage()
    usage.update(data.get("usage"))
    piece = usage.piece()
    if piece:
        yield piece


def stream_messages(
    config: ModelConfig,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    client: httpx.Client | None = None,
    take: Take[T] = hand_over,
    output_schema: Mapping[str, Any] | None = None,
) -> Iterator[T]:
    """Stream one message: `TextDelta`s, each `ToolCall` at the end of its block, `Usage` last,
    each given to `take` (by default yielded as they are; see `gateway.open_stream`).

    Raises `ModelError`. Closing the generator closes the HTTP response.
    """
    url = transport.model_url(config, "/messages")
    body = _request_body(config, messages, tools, output_schema)
    headers = _headers(config)
    if output_schema is not None:
        headers["anthropic-beta"] = ",".join(
            filter(None, [headers.get("anthropic-beta"), STRUCTURED_OUTPUTS_BETA]))
    yield from transport.stream_with_retries(
        config, url, body=body, headers=headers, decoder=MessagesDecoder,
        whole=_parse_whole, take=take, client=client)
