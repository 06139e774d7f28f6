"""A real Anthropic Messages API server for tests, on a free loopback port.

    with FakeAnthropic() as api:
        api.script("m", [Turn(text="Hello"), Turn(fail_status=529)])
        config = ModelConfig(provider="anthropic", base_url=api.url, model="m", api_key_env=None)
        ...
        api.requests("m")         # the JSON bodies received, in order, each with `received_at`
        api.request_headers("m")  # their headers (lower-case names)
        api.events("m")           # per request: the event payloads sent, in order
        api.stream_log("m")       # per request: [(monotonic time, text chars sent so far), ...]
        api.outcomes("m")         # per request: "complete", "failed", "dropped", ...

    # a real provider's rate limits, for every model (each its own) or one model:
    with FakeAnthropic(rate_limit=RateLimit(requests_per_window=50, window_s=60)) as api:
        api.limit("m", RateLimit(max_in_flight=4, tokens_per_window=40_000))
        api.script_default("m", lambda body: Turn(text="Hello"))
        ...
        api.refused("m")             # how many requests the limiter answered with 429
        api.admitted("m")            # per admitted request: (monotonic admitted, finished or None)
        api.in_flight("m")           # admitted requests whose answer is not finished yet
        api.max_in_flight_seen("m")  # the peak of in_flight

The same scripting as `tests/fake_llm.py` (whose lifecycle, bookkeeping, rate limiter and HTTP
plumbing it reuses): each request for a model pops that model's next `Turn`; a request with
none left is answered by the model's default (`script_default`), or without one gets a 400
naming the model. `POST /v1/messages` with `"stream": true` gets the Messages stream, one
server-sent event per HTTP chunk (`event: <type>` and `data: <json>`): `message_start` (with
the usage so far), `ping`, then a `text` block whose `text_delta`s are paced at
`tokens_per_second` (one delta = one token of `chunk_chars` characters), then one `tool_use`
block per tool call whose input is sent as `input_json_delta` fragments of `chunk_chars`
characters, each block closed by `content_block_stop`, then `message_delta` (stop_reason and
usage) and `message_stop`. Without `stream` it answers one `message` object. Errors have
Anthropic's shape (`{"type": "error", "error": {"type": ..., "message": ...}}`).

Requests are checked as the API does, in the few ways that matter here: the
`anthropic-version` header, and `model`, `max_tokens` and `messages` in the body (a 400
otherwise). The event payloads follow the official SDK's types
(`anthropic.types.RawMessageStreamEvent`); tests/unit/test_anthropic.py checks every event
sent against them.

Rate limits (`RateLimit`, from tests/fake_llm.py) are applied as there, after the request's
checks (an invalid request is answered 400 and counts against nothing), with Anthropic's
headers: a refused request gets a 429 `rate_limit_error` (Anthropic's overload is a scripted
529, not a rate limit) with `retry-after` (whole seconds) and, like every answer to an admitted
request, `anthropic-ratelimit-requests-limit`, `-requests-remaining` and `-requests-reset` (an
RFC 3339 UTC timestamp with milliseconds: when the window is wholly free again, "fully
replenished" in Anthropic's words). With `tokens_per_window` also `anthropic-ratelimit-tokens-`
and `anthropic-ratelimit-input-tokens-` `limit`/`remaining`/`reset`, both the fake's one budget
of a request's estimated tokens (its system and messages' JSON length / 4, as
`usage.input_tokens` reports them, plus `max_tokens`), and not rounded to thousands as
Anthropic's are.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.fake_llm import (
    FakeLLM,
    RateLimit,
    _Admission,
    _Dropped,
    _Handler,
    _rfc3339,
    _tokens,
    continued,
)

__all__ = ["ERROR_TYPES", "FakeAnthropic", "RateLimit", "Turn"]

#: Anthropic's error type for each HTTP status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 504: "timeout_error",
               529: "overloaded_error"}


@dataclass
class Turn:
    """One scripted answer.

    `text`: streamed as one text block; `tokens_per_second`/`chunk_chars`: pacing (each
    text delta and each input fragment is one token of `chunk_chars` characters);
    `tool_calls`: `{"id", "name", "arguments"}` with arguments a dict or raw text (sent
    verbatim as `partial_json` fragments, may be invalid JSON), one `tool_use` block each;
    `thinking`: a thinking block sent before the text; `fail_status`: answer with this HTTP
    status and an error body (`error_message`, type from `ERROR_TYPES`) instead;
    `fail_after_chars`: stream that many characters of text, then drop the connection
    without ending the body; `stream_error`: after the text and tool calls, send an `error`
    event with this `{"type", "message"}` instead of finishing; `usage`: report usage in
    `message_start`/`message_delta` (zeros otherwise); `cache_read_tokens`/
    `cache_creation_tokens`: reported in `message_start`; `stop_reason`: default `tool_use`
    when there are tool calls, else `end_turn`; `headers`: extra response headers (e.g.
    `{"Retry-After": "1"}`); `delay_s`: wait this long before answering at all; `holds`:
    block index -> an event the test sets: after that block's `content_block_stop` nothing
    more is written until it is set (see `FakeLLM`'s `Turn.hold_after_chars`).
    """

    text: str = ""
    tokens_per_second: float = 200
    chunk_chars: int = 4
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    thinking: str = ""
    fail_status: int | None = None
    fail_after_chars: int | None = None
    stream_error: dict[str, str] | None = None
    usage: bool = True
    cache_read_tokens: int = 0
    cache_creation_tokens: int = 0
    stop_reason: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    error_message: str | None = None
    holds: dict[int, threading.Event] = field(default_factory=dict)


class FakeAnthropic(FakeLLM):
    """The server; a context manager. `url` is the base URL, ending in `/v1` (Cortex's
    `base_url`); `root_url` is without it (the SDK's `base_url`)."""

    _name = "fake-anthropic"

    def __init__(self, host: str = "127.0.0.1", *, keep_alive: bool = True,
                 rate_limit: RateLimit | None = None) -> None:
        super().__init__(host, keep_alive=keep_alive, rate_limit=rate_limit)
        self._events: dict[str, list[list[dict[str, Any]]]] = {}

    @property
    def root_url(self) -> str:
        return self.url.removesuffix("/v1")

    def script(self, model: str, turns: list[Turn]) -> None:  # type: ignore[override]
        """Append turns for `model`; each request pops the next one."""
        super().script(model, turns)  # type: ignore[arg-type]

    def script_default(self, model: str,  # type: ignore[override]
                       make: Callable[[dict[str, Any]], Turn] | None) -> None:
        """Answer a request for `model` that finds no scripted turn left with `make(its JSON
        body)` instead of a 400; None: the 400 again."""
        super().script_default(model, make)  # type: ignore[arg-type]

    def events(self, model: str) -> list[list[dict[str, Any]]]:
        """Per request: the payload of every server-sent event written, in order."""
        with self._lock:
            return [list(sent) for sent in self._events.get(model, [])]

    def _new_request(self, model: str, body: dict[str, Any], headers: dict[str, str],
                     outcome: str) -> int:
        self._events.setdefault(model, []).append([])
        return super()._new_request(model, body, headers, outcome)

    def _record(self, model: str, body: dict[str, Any], headers: dict[str, str], *,
                take: bool = True) -> tuple[int, Turn | None]:  # type: ignore[override]
        """Record a request; pop its turn (or make the default one) unless `take` is False (a
        request the API refuses)."""
        with self._lock:
            index = self._new_request(model, body, headers, "streaming")
            turns = self._turns.get(model)
            turn = turns.pop(0) if take and turns else None
        if take and turn is None:
            turn = self._default_turn(model, body)
        return index, continued(turn, body)

    def _sent(self, model: str, index: int, payload: dict[str, Any]) -> None:
        with self._lock:
            self._events[model][index].append(payload)

def _arguments_text(call: dict[str, Any]) -> str:
    arguments = call.get("arguments", {})
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def _tool_id(call: dict[str, Any], number: int) -> str:
    return str(call.get("id") or f"toolu_{number:02d}")


class _MessagesHandler(_Handler):
    fake: FakeAnthropic  # type: ignore[assignment]  # set on the subclass made by start

    # -- plumbing ---------------------------------------------------------------------------
    def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        self._send_json(status, {"type": "error", "error": {
            "type": ERROR_TYPES.get(status, "api_error"), "message": message}},
            {"request-id": f"req_{uuid.uuid4().hex[:12]}", **(headers or {})})

    def _sse(self, model: str, index: int, payload: dict[str, Any], *, last: bool = False) -> None:
        self.fake._sent(model, index, payload)
        self._chunk(f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n".encode(),
                    last=last)

    # -- routes -------------------------------------------------------------------------------
    def do_GET(self) -> None:
        self._error(404, f"FakeAnthropic serves POST /v1/messages, not GET {self.path}")

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)  # all of it, so the connection can carry the next request
        if self.path.rstrip("/") != "/v1/messages":
            self._error(404, f"FakeAnthropic serves POST /v1/messages, not {self.path}")
            return
        try:
            body = json.loads(raw)
            model = str(body["model"])
        except (ValueError, KeyError, TypeError):
            self._error(400, "model: Field required (the body must be JSON with a 'model')")
            return
        headers = {k.lower(): v for k, v in self.headers.items()}
        fake = self.fake
        problem = self._invalid(body, headers)
        if problem:
            index, _ = fake._record(model, body, headers, take=False)
            fake._outcome(model, index, "invalid")
            self._error(400, problem)
            return
        self._admit_and_answer(model, body, headers)

    def _answer(self, model: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        fake = self.fake
        index, turn = fake._record(model, body, headers)
        if turn is None:
            fake._outcome(model, index, "no_turn")
            self._error(400, f"FakeAnthropic has no scripted turn left for model {model!r} "
                             f"(this is request {index + 1}); script more with "
                             "FakeAnthropic.script()")
            return
        try:
            fake._wait(turn.delay_s)
            if turn.fail_status is not None:
                fake._outcome(model, index, "failed")
                self._error(turn.fail_status, turn.error_message
                            or f"FakeAnthropic scripted failure {turn.fail_status}", turn.headers)
            elif body.get("stream"):
                self._ending = (model, index, "stream_error" if turn.stream_error else "complete")
                self._stream(model, index, body, turn)
                fake._outcome(model, index, "stream_error" if turn.stream_error else "complete")
            else:
                self._ending = (model, index, "complete")
                self._whole(model, index, body, turn)
                fake._outcome(model, index, "complete")
        except _Dropped:
            fake._outcome(model, index, "dropped")
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            fake._outcome(model, index, "client_disconnected")
            self.close_connection = True

    # -- rate limits --------------------------------------------------------------------------
    def _token_cost(self, body: dict[str, Any]) -> int:
        prompt = _tokens(len(json.dumps([body.get("system"), body.get("messages", [])])))
        most = body.get("max_tokens")
        return prompt + (most if isinstance(most, int) else 0)

    def _limit_headers(self, a: _Admission) -> dict[str, str]:
        """Anthropic's rate-limit headers for the window `a` left."""
        limit = a.limit
        if limit is None or not limit.counts:
            return {}
        reset = _rfc3339(a.empties_at())
        headers: dict[str, str] = {}
        if limit.requests_per_window is not None:
            headers["anthropic-ratelimit-requests-limit"] = str(limit.requests_per_window)
            headers["anthropic-ratelimit-requests-remaining"] = str(
                max(0, limit.requests_per_window - a.requests))
            headers["anthropic-ratelimit-requests-reset"] = reset
        if limit.tokens_per_window is not None:
            remaining = str(max(0, limit.tokens_per_window - a.tokens))
            for kind in ("tokens", "input-tokens"):
                headers[f"anthropic-ratelimit-{kind}-limit"] = str(limit.tokens_per_window)
                headers[f"anthropic-ratelimit-{kind}-remaining"] = remaining
                headers[f"anthropic-ratelimit-{kind}-reset"] = reset
        return headers

    def _rate_limited(self, model: str, a: _Admission) -> None:
        """Refuse a request as Anthropic does."""
        self._error(429, self._limit_message(model, a), self._refusal_headers(a))

    @staticmethod
    def _invalid(body: dict[str, Any], headers: dict[str, str]) -> str | None:
        if "anthropic-version" not in headers:
            return "anthropic-version: header is required"
        if not isinstance(body.get("max_tokens"), int):
            return "max_tokens: Field required"
        if not isinstance(body.get("messages"), list):
            return "messages: Field required"
        return None

    # -- answers ------------------------------------------------------------------------------
    def _usage(self, body: dict[str, Any], turn: Turn) -> tuple[int, int]:
        if not turn.usage:
            return 0, 0
        prompt = _tokens(len(json.dumps([body.get("system"), body.get("messages", [])])))
        completion = _tokens(len(turn.text) + len(turn.thinking)
                             + sum(len(_arguments_text(c)) for c in turn.tool_calls))
        return prompt, completion

    def _stop_reason(self, turn: Turn) -> str:
        return turn.stop_reason or ("tool_use" if turn.tool_calls else "end_turn")

    def _message(self, model: str, body: dict[str, Any], turn: Turn, *,
                 content: list[dict[str, Any]], output_tokens: int,
                 stop_reason: str | None) -> dict[str, Any]:
        prompt, _ = self._usage(body, turn)
        return {
            "id": f"msg_{uuid.uuid4().hex[:20]}", "type": "message", "role": "assistant",
            "model": model, "content": content, "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt, "output_tokens": output_tokens,
                      "cache_creation_input_tokens": turn.cache_creation_tokens if turn.usage else 0,
                      "cache_read_input_tokens": turn.cache_read_tokens if turn.usage else 0},
        }

    def _whole(self, model: str, index: int, body: dict[str, Any], turn: Turn) -> None:
        content: list[dict[str, Any]] = []
        if turn.text:
            content.append({"type": "text", "text": turn.text})
        for number, call in enumerate(turn.tool_calls):
            arguments = call.get("arguments", {})
            content.append({"type": "tool_use", "id": _tool_id(call, number),
                            "name": call["name"],
                            "input": arguments if isinstance(arguments, dict) else {}})
        payload = self._message(model, body, turn, content=content,
                                output_tokens=self._usage(body, turn)[1],
                                stop_reason=self._stop_reason(turn))
        self._send_json(200, payload, turn.headers)
        self.fake._log(model, index, len(turn.text))

    def _stream(self, model: str, index: int, body: dict[str, Any], turn: Turn) -> None:
        fake = self.fake
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("request-id", f"req_{uuid.uuid4().hex[:12]}")
        self._end_headers(turn.headers)

        def sse(payload: dict[str, Any]) -> None:
            self._sse(model, index, payload)

        def stop(block: int) -> None:
            sse({"type": "content_block_stop", "index": block})
            if block in turn.holds:
                fake._hold(turn.holds[block])

        interval = 1.0 / turn.tokens_per_second
        start = time.monotonic()
        tick = 0

        def pace() -> None:
            nonlocal tick
            fake._wait(start + tick * interval - time.monotonic())
            tick += 1

        size = max(1, turn.chunk_chars)
        limit = turn.fail_after_chars
        _, completion = self._usage(body, turn)
        sse({"type": "message_start", "message": self._message(
            model, body, turn, content=[], output_tokens=1 if turn.usage else 0,
            stop_reason=None)})
        sse({"type": "ping"})
        if limit == 0:
            self._drop()
        block = 0
        if turn.thinking:
            sse({"type": "content_block_start", "index": block,
                 "content_block": {"type": "thinking", "thinking": "", "signature": ""}})
            for offset in range(0, len(turn.thinking), size):
                pace()
                sse({"type": "content_block_delta", "index": block, "delta": {
                    "type": "thinking_delta", "thinking": turn.thinking[offset:offset + size]}})
            sse({"type": "content_block_delta", "index": block,
                 "delta": {"type": "signature_delta", "signature": "c2lnbmVk"}})
            stop(block)
            block += 1
        sent = 0
        if turn.text:
            sse({"type": "content_block_start", "index": block,
                 "content_block": {"type": "text", "text": ""}})
            for offset in range(0, len(turn.text), size):
                piece = turn.text[offset:offset + size]
                if limit is not None:
                    piece = piece[:limit - sent]
                pace()
                sse({"type": "content_block_delta", "index": block,
                     "delta": {"type": "text_delta", "text": piece}})
                sent += len(piece)
                fake._log(model, index, sent)
                if limit is not None and sent >= limit:
                    self._drop()
            stop(block)
            block += 1
        for number, call in enumerate(turn.tool_calls):
            pace()
            sse({"type": "content_block_start", "index": block, "content_block": {
                "type": "tool_use", "id": _tool_id(call, number), "name": call["name"],
                "input": {}}})
            arguments = _arguments_text(call)
            for offset in range(0, len(arguments), size):
                pace()
                sse({"type": "content_block_delta", "index": block, "delta": {
                    "type": "input_json_delta", "partial_json": arguments[offset:offset + size]}})
            stop(block)
            block += 1
        if limit is not None:  # fewer characters than the limit: drop before finishing
            self._drop()
        if turn.stream_error is not None:
            sse({"type": "error", "error": dict(turn.stream_error)})
            self._chunk(b"")
            return
        sse({"type": "message_delta",
             "delta": {"stop_reason": self._stop_reason(turn), "stop_sequence": None},
             "usage": {"output_tokens": completion}})
        self._sse(model, index, {"type": "message_stop"}, last=True)


FakeAnthropic._handler = _MessagesHandler
