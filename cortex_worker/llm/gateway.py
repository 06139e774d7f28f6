"""Streaming chat completions from an OpenAI-compatible endpoint, over plain httpx; and the
provider table.

* `stream_chat(config, messages, tools=)` yields `TextDelta`s as the server sends them, each
  native `ToolCall` (assembled from its fragments) as soon as it is complete (when its
  arguments close their JSON object, when the next call starts, or when the model finishes:
  whichever comes first), and a `Usage` at the end when the server reports one.
* Retries (`transport.stream_with_retries`, shared with the Anthropic provider): connection
  errors, timeouts, 408, 429 and 5xx are retried up to `config.max_retries` times with
  exponential backoff (0.25 s base, jitter, `Retry-After` honoured up to 10 s), but only while
  nothing has been yielded. Once the caller has seen a piece, a failure raises
  `ModelError(retryable=True, streamed=<chars>)` and the caller decides (the coordinator
  restarts the turn). Other 4xx raise `ModelError(retryable=False)` with the server's message.
* The generator may be closed early (`gen.close()`): the HTTP response is closed at once.
* `open_stream(...)` picks the stream by `config.provider` from `PROVIDERS`: `openai` (this
  module), `anthropic` (the Messages API, `anthropic.py`) or `replay` (a recorded transcript,
  `replay.py`). `complete(config, messages)` joins a stream (for `type="llm"` actions).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from cortex_worker.llm import transport
from cortex_worker.llm.anthropic import stream_messages
from cortex_worker.llm.config import ModelConfig, function_name
from cortex_worker.llm.grammar import Grammar, request_fields
from cortex_worker.llm.replay import replay_stream
from cortex_worker.llm.sse import T, Take, hand_over, json_event, taken
from cortex_worker.llm.stream import ModelError, Piece, TextDelta, ToolCall, Usage
from cortex_worker.llm.transport import close_shared_client, shared_client
from cortex_worker.observability import tracing

log = logging.getLogger(__name__)

__all__ = ["PROVIDERS", "close_shared_client", "complete", "open_stream", "shared_client",
           "stream_chat"]


def _request_body(config: ModelConfig, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None, *, stream: bool = True,
                  grammar: Grammar | None = None,
                  output_schema: Mapping[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": config.model, "messages": messages, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if config.temperature is not None:
        body["temperature"] = config.temperature
    if config.max_tokens is not None:
        body["max_tokens"] = config.max_tokens
    if config.seed is not None:
        body["seed"] = config.seed
    if tools:
        body["tools"] = tools
        forced = config.forced_tool
        if forced is not None:
            body["tool_choice"] = {"type": "function", "function": {"name": function_name(forced)}}
        elif config.tool_choice != "auto":  # absent is auto: vLLM refuses "auto" without a flag
            body["tool_choice"] = config.tool_choice
    if output_schema is not None:  # a model that answers in plain text answers this JSON
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": dict(output_schema)}}
    if config.continuation == "continue_final_message" and messages[-1]["role"] == "assistant":
        body.update(continue_final_message=True, add_generation_prompt=False)  # vLLM, SGLang
    if grammar is not None:  # the fields of the engine of `config.grammar` (grammar.FLAVOURS)
        if config.grammar is None:
            raise ModelError("a grammar was given, but the model's `grammar` names no flavour "
                             "(gbnf, lark, ebnf or structural_tag)")
        body.update(request_fields(config.grammar, grammar))
    return body


def _headers(config: ModelConfig) -> dict[str, str]:
    headers = {"Accept": "text/event-stream", "Content-Type": "application/json"}
    key = transport.model_key(config)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return headers


# -- SSE -------------------------------------------------------------------------------------
_JSON_MARKS = re.compile(r'["\\{}]')
_DECODER = json.JSONDecoder()


@dataclass(slots=True)
class _Call:
    """One native call's fragments. A scan of its arguments notices each JSON object they
    close (each character looked at once, across fragment boundaries); the objects are then
    decoded from where the last one ended."""

    index: int
    id: str = ""
    name: str = ""
    text: list[str] = field(default_factory=list)
    scan: str = "start"  # start (blank since the last object), object, other (not objects)
    depth: int = 0
    in_string: bool = False
    escaped: bool = False  # the last fragment ended on a backslash inside a string
    objects: list[tuple[dict[str, Any], str]] = field(default_factory=list)  # decoded
    decoded_to: int = 0  # the characters the objects span
    used: int = 0  # the objects looked at by `_ToolCallBuffer._ready`
    handed: int = 0  # calls handed out
    last: dict[str, Any] | None = None  # the arguments of the last one

    def extend(self, text: str) -> bool:
        """Add argument text; True if it closes one or more objects (now in `objects`)."""
        self.text.append(text)
        closed, at = False, 0
        if self.escaped and text:
            at, self.escaped = 1, False
        while at < len(text) and self.scan != "other":
            if self.scan == "start":
                rest = text[at:].lstrip()
                if not rest:
                    break
                at = len(text) - len(rest)
                self.scan = "object" if rest[0] == "{" else "other"
                continue
            while (mark := _JSON_MARKS.search(text, at)) is not None:
                char, at = mark.group(), mark.end()
                if self.in_string:
                    if char == "\\":
                        self.escaped, at = at == len(text), at + 1
                    elif char == '"':
                        self.in_string = False
                elif char == '"':
                    self.in_string = True
                elif char == "{":
                    self.depth += 1
                elif char == "}":
                    self.depth -= 1
                    if self.depth == 0:
                        self.scan, closed = "start", True
                        break
            else:
                break  # the fragment ended inside the object
        if closed:
            self._decode()
        return closed

    def _decode(self) -> None:
        """Decode the objects closed since the last one; a closed one that is not JSON ends
        the scan (the call then waits for the end of the message)."""
        whole = "".join(self.text)
        while True:
            start = len(whole) - len(whole[self.decoded_to:].lstrip())
            if start == len(whole) or whole[start] != "{":
                return
            try:
                value, end = _DECODER.raw_decode(whole, start)
            except (ValueError, RecursionError):
                if self.depth == 0:  # a whole object, and not JSON
                    self.scan = "other"
                return
            self.objects.append((value, whole[start:end]))
            self.decoded_to = end

    @property
    def label(self) -> str:
        """Its id, or one made from its index when the server sent none."""
        return self.id or f"call_{self.index}"

    def rest(self) -> str:
        """What follows the last decoded object."""
        return "".join(self.text)[self.decoded_to:]


class _ToolCallBuffer:
    """Accumulates `delta.tool_calls` fragments by index and hands out each call once it is
    complete: when its arguments close their JSON object, when a later index starts, or at
    the end of the message, whichever comes first.

    Servers' quirks, seen in the wild, are undone here: an empty object sent before the
    arguments (`{}{"a": 1}`: Gemini's OpenAI-compatible endpoint) is a placeholder; the same
    object twice (`{"a": 1}{"a": 1}`: vLLM's xlam parser) is one call; other objects run
    together (`{"a": 1}{"a": 2}`: Gemini's parallel calls) are calls of their own, with ids
    `<id>_2`, `<id>_3`…; and calls that all come as index 0 with ids of their own (Ollama)
    are told apart by those ids."""

    def __init__(self) -> None:
        self._calls: dict[int, _Call] = {}

    def add(self, fragments: list[Any]) -> list[ToolCall]:
        """Take fragments in; the calls they complete, in their order."""
        ready = []
        for position, fragment in enumerate(fragments):
            if not isinstance(fragment, dict):
                continue
            index = fragment.get("index", position)
            function = fragment.get("function") or {}
            arguments = function.get("arguments")
            if isinstance(arguments, dict):  # some servers send the object itself
                arguments = json.dumps(arguments)
            id_ = str(fragment.get("id") or "")
            call = self._calls.get(index)
            if call is not None and id_ and call.id and call.id != id_:
                ready.extend(self._finish(index))  # the index was used again: a new call
                call = None
            if call is None:
                call = self._calls[index] = _Call(index)
            if id_ and not call.id:
                call.id = id_
            name = function.get("name")
            if name and name != call.name:
                call.name += str(name)
            if isinstance(arguments, str) and call.extend(arguments) and call.name:
                ready.extend(self._ready(call, final=False))
        return ready

    def complete_before(self, fragments: list[Any]) -> list[ToolCall]:
        """The calls these fragments show to be complete: OpenAI streams one call's fragments
        after another, so once a later index starts, every earlier one has all its arguments
        (and can run while the model writes the next)."""
        starts = [f.get("index", position) for position, f in enumerate(fragments)
                  if isinstance(f, dict)]
        if not starts or not all(isinstance(i, int) for i in [*starts, *self._calls]):
            return []
        return [c for i in list(self._calls) if i < min(starts) for c in self._finish(i)]

    def flush(self) -> list[ToolCall]:
        """The calls still open at the end of the message, in the order they began."""
        return [c for i in list(self._calls) for c in self._finish(i)]

    def _finish(self, index: int) -> list[ToolCall]:
        """A call is complete: the calls its arguments make that were not handed out yet."""
        call = self._calls.pop(index)
        calls = self._ready(call, final=True)
        if not call.handed:  # no arguments, or none that are JSON objects: reported as written
            return [ToolCall.from_raw(call.label, call.name, "".join(call.text))]
        rest = call.rest().strip()
        if rest:
            log.warning("native tool call %s (index %s) went on after its arguments' JSON "
                        "object: ignored %.200r", call.label, index, rest)
        return calls

    def _ready(self, call: _Call, *, final: bool) -> list[ToolCall]:
        """The calls made by objects decoded since the last look (see the class docstring);
        a lone leading `{}` waits, unless the call is complete, for what may follow it."""
        calls = []
        base = call.label
        while call.used < len(call.objects):
            value, raw = call.objects[call.used]
            more = call.used + 1 < len(call.objects)
            if not value and not call.handed and not more and not final:
                break
            call.used += 1
            if (not value and not call.handed and more) or (call.handed and value == call.last):
                continue  # a placeholder, or a copy of the call before
            call.handed += 1
            call.last = value
            calls.append(ToolCall(base if call.handed == 1 else f"{base}_{call.handed}",
                                  call.name, value, raw))
        return calls


class ChatDecoder:
    """The pieces of a `chat.completion.chunk` stream, one server-sent event at a time
    (`transport.Decoder`)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.calls = _ToolCallBuffer()
        self.finished = self.done = False

    def event(self, name: str, data: str) -> list[Piece]:
        if data.strip() == "[DONE]":
            self.finished = self.done = True
            return []
        chunk = json_event(self.url, data)
        if chunk is None:
            return []
        if chunk.get("error"):
            error = chunk["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            raise ModelError(f"model endpoint {self.url} reported an error mid-stream: {message}",
                             retryable=True)
        pieces: list[Piece] = []
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if content:
                pieces.append(TextDelta(content))
            if delta.get("tool_calls"):
                pieces.extend(self.calls.complete_before(delta["tool_calls"]))
                pieces.extend(self.calls.add(delta["tool_calls"]))
            if choice.get("finish_reason"):
                self.finished = True
                pieces.extend(self.calls.flush())
        usage = _usage(chunk.get("usage"))
        if usage:
            pieces.append(usage)
        return pieces

    def end(self) -> list[Piece]:
        if not self.finished:
            raise ModelError(f"model endpoint {self.url} ended the stream before the completion "
                             "finished (no finish_reason and no [DONE])", retryable=True)
        return list(self.calls.flush())


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
    yield from calls.add(message.get("tool_calls") or [])
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
    grammar: Grammar | None = None,
    take: Take[T] = hand_over,
    output_schema: Mapping[str, Any] | None = None,
) -> Iterator[T]:
    """Stream one chat completion: `TextDelta`s, then complete `ToolCall`s, then `Usage`,
    each given to `take` (by default yielded as they are; see `open_stream`).

    `grammar` (from `grammar.build_grammar`) constrains the decoding, sent in the request
    fields of the flavour `config.grammar`; `output_schema`, a text answer (as
    `response_format`). Raises `ModelError`. Closing the generator closes the HTTP response.
    """
    url = transport.model_url(config, "/chat/completions")
    yield from transport.stream_with_retries(
        config, url, body=_request_body(config, messages, tools, grammar=grammar,
                                        output_schema=output_schema),
        headers=_headers(config), decoder=ChatDecoder, whole=_parse_whole, take=take,
        client=client)


Provider = Callable[
    [ModelConfig, list[dict[str, Any]], list[dict[str, Any]] | None, httpx.Client | None,
     str | Path | None, Grammar | None, Mapping[str, Any] | None, Take[Any]],
    Iterator[Any]]
"""`(config, messages, tools, client, base_dir, grammar, output_schema, take) -> what take
hands over`: one entry of `PROVIDERS`. Only `openai` (OpenAI-compatible engines) constrains
decoding; a replay ignores a grammar and an output schema."""

PROVIDERS: dict[str, Provider] = {
    "openai": lambda config, messages, tools, client, base_dir, grammar, output, take:
        stream_chat(config, messages, tools=tools, client=client, grammar=grammar, take=take,
                    output_schema=output),
    "anthropic": lambda config, messages, tools, client, base_dir, grammar, output, take:
        stream_messages(config, messages, tools=tools, client=client, take=take,
                        output_schema=output),
    "replay": lambda config, messages, tools, client, base_dir, grammar, output, take: taken(
        replay_stream(config, messages, base_dir=base_dir), take),
}
"""The stream of each `ModelConfig.provider`."""


def open_stream(
    config: ModelConfig,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    client: httpx.Client | None = None,
    base_dir: str | Path | None = None,
    grammar: Grammar | None = None,
    take: Take[T] = hand_over,
    output_schema: Mapping[str, Any] | None = None,
) -> Iterator[T]:
    """A stream from the configured provider (`PROVIDERS`): an OpenAI-compatible endpoint,
    Anthropic's Messages API, or a replayed transcript.

    Each piece (`TextDelta`, `ToolCall`, `Usage`) is given to `take`, in whichever thread
    reads the stream (`reader.py`), and what `take` returns other than None is yielded here.
    By default every piece is yielded. `base_dir` (the manifests directory) is where a
    relative replay transcript may live. `grammar`: `build_grammar(agent, registry,
    config.grammar)`, or None. `output_schema`: the JSON Schema a text answer must match, sent
    where the provider enforces one (a model that calls native tools and answers in text).
    """
    provider = PROVIDERS[config.provider]
    return tracing.model_stream(config, lambda observed: provider(
        config, messages, tools, client, base_dir, grammar, output_schema, observed), take)


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
        transport._sleep(transport.backoff(used - 1, None))
