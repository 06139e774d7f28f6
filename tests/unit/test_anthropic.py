"""The Anthropic Messages provider (cortex_worker.llm.anthropic) against a real HTTP server on
loopback (tests.fake_anthropic), and that server against the official `anthropic` SDK: every
event it sends is validated with the SDK's types, the requests Cortex sends with the SDK's
request types, and the SDK's own client reads the fake's streams."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, get_args

import anthropic as anthropic_sdk
import httpx
import pytest
from anthropic.types import (
    ErrorResponse,
    RawMessageStreamEvent,
    TextBlockParam,
    ToolParam,
    ToolResultBlockParam,
    ToolUseBlockParam,
)
from anthropic.types.message_create_params import MessageCreateParamsStreaming
from pydantic import BaseModel, TypeAdapter

from cortex_worker.agents.prompt import RESULT_STATUSES
from cortex_worker.llm import gateway, transport
from cortex_worker.llm.anthropic import (
    DEFAULT_MAX_TOKENS,
    ERROR_STATUSES,
    MessagesDecoder,
    stream_messages,
    to_messages_request,
)
from cortex_worker.llm.config import ModelConfig
from cortex_worker.llm.sse import decode_lines
from cortex_worker.llm.stream import ModelError, TextDelta, ToolCall, Usage, tool_call_to_protocol
from cortex_worker.protocol import parser as p
from cortex_worker.protocol.parser import parse_document
from tests.fake_anthropic import ERROR_TYPES, FakeAnthropic, Turn

pytestmark = pytest.mark.unit

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say hello."}]
TOOLS = [
    {"type": "function", "function": {
        "name": "echo", "description": "Echo a message back.",
        "parameters": {"type": "object", "properties": {"message": {"type": "string"}},
                       "required": ["message"]}}},
    {"type": "function", "function": {
        "name": "calculator",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}},
]


# -- fixtures and helpers ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def api() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as server:
        yield server


@pytest.fixture
def model(request: pytest.FixtureRequest) -> str:
    """A model name of its own for each test, so scripts never mix."""
    return request.node.name


def config(api: FakeAnthropic, model: str, **overrides: Any) -> ModelConfig:
    return ModelConfig(**{"provider": "anthropic", "base_url": api.url, "model": model,
                          "api_key_env": None, **overrides})


def text_of(pieces: list[Any]) -> str:
    return "".join(piece.text for piece in pieces if isinstance(piece, TextDelta))


def failure(gen: Iterator[Any]) -> ModelError:
    with pytest.raises(ModelError) as info:
        for _ in gen:
            pass
    return info.value


def settled(api: FakeAnthropic, model: str, timeout: float = 5.0) -> list[str]:
    """The server's outcomes once none is still `streaming`."""
    deadline = time.monotonic() + timeout
    while "streaming" in api.outcomes(model) and time.monotonic() < deadline:
        time.sleep(0.01)
    return api.outcomes(model)


_EVENT = TypeAdapter(RawMessageStreamEvent)
_ERROR = TypeAdapter(ErrorResponse)


def no_extras(value: Any, where: str = "event") -> None:
    """The SDK's models accept unknown fields: a field the SDK does not know is a typo here."""
    if isinstance(value, BaseModel):
        assert not value.model_extra, f"{where}: fields unknown to the SDK: {value.model_extra}"
        for name in type(value).model_fields:
            no_extras(getattr(value, name), f"{where}.{name}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            no_extras(item, f"{where}[{i}]")


def sdk_event(payload: dict[str, Any]) -> None:
    """Validate one event payload with the official SDK's types."""
    if payload["type"] == "ping":
        assert payload == {"type": "ping"}
    elif payload["type"] == "error":
        no_extras(_ERROR.validate_python(payload))
    else:
        no_extras(_EVENT.validate_python(payload))


def strict(typed_dict: Any, value: Any, where: str) -> None:
    """`value` has the SDK TypedDict's required keys, no others, and its types."""
    assert isinstance(value, dict), where
    keys = typed_dict.__required_keys__ | typed_dict.__optional_keys__
    assert typed_dict.__required_keys__ <= set(value) <= keys, (where, sorted(value))
    TypeAdapter(typed_dict).validate_python(value)


_BLOCKS = {"text": TextBlockParam, "tool_use": ToolUseBlockParam,
           "tool_result": ToolResultBlockParam}


def sdk_request(body: dict[str, Any]) -> None:
    """Validate a request body Cortex sent with the SDK's request types (TypedDicts, walked by
    hand: pydantic validates their iterables lazily and ignores unknown keys). `temperature`
    is a field of API version 2023-06-01, which Cortex sends; the SDK 2.x types follow version
    2026-10-21, which removed it."""
    body = {k: v for k, v in body.items() if k not in ("received_at", "temperature")}
    strict(MessageCreateParamsStreaming, {**body, "messages": [], "tools": []}, "body")
    assert isinstance(body["system"], str) if "system" in body else True
    for i, message in enumerate(body["messages"]):
        assert set(message) == {"role", "content"} and message["role"] in ("user", "assistant")
        for j, block in enumerate(message["content"]):
            strict(_BLOCKS[block["type"]], block, f"messages[{i}].content[{j}]")
    for i, tool in enumerate(body.get("tools", [])):
        strict(ToolParam, tool, f"tools[{i}]")


# -- conversion ----------------------------------------------------------------------------------
def test_a_conversation_with_tool_calls_becomes_messages_api_shaped() -> None:
    conversation = [
        {"role": "system", "content": "You are Cortex."},
        {"role": "user", "content": "Ping, multiply, and break something."},
        {"role": "assistant", "content": "<thought>Three at once.</thought>", "tool_calls": [
            {"id": "toolu_a", "type": "function",
             "function": {"name": "echo", "arguments": '{"message": "ping"}'}},
            {"id": "toolu_b", "type": "function",
             "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'}},
            {"id": "toolu_c", "type": "function",
             "function": {"name": "echo", "arguments": '{"message": "unterminated'}},
            {"id": "toolu_d", "type": "function",
             "function": {"name": "list_context_feeds", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "toolu_a", "content": "ping"},
        {"role": "tool", "tool_call_id": "toolu_b", "content": "timeout: took longer than 5 s"},
        {"role": "tool", "tool_call_id": "toolu_c",
         "content": "error: this call did not run (see the protocol errors in the next message)"},
        {"role": "tool", "tool_call_id": "toolu_d", "content": ""},
        {"role": "user", "content": "<protocol_errors>...</protocol_errors>"},
        {"role": "assistant", "content": ""},  # a turn that said nothing: left out
        {"role": "user", "content": "  "},  # whitespace only: left out too
        {"role": "user", "content": [{"type": "text", "text": "Go on."}]},
    ]
    request = to_messages_request(conversation, TOOLS)
    assert request["system"] == "You are Cortex."
    assert request["messages"] == [
        {"role": "user", "content": [
            {"type": "text", "text": "Ping, multiply, and break something."}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "<thought>Three at once.</thought>"},
            {"type": "tool_use", "id": "toolu_a", "name": "echo", "input": {"message": "ping"}},
            {"type": "tool_use", "id": "toolu_b", "name": "calculator",
             "input": {"expression": "6*7"}},
            {"type": "tool_use", "id": "toolu_c", "name": "echo",
             "input": {"INVALID_JSON": '{"message": "unterminated'}},
            {"type": "tool_use", "id": "toolu_d", "name": "list_context_feeds", "input": {}}]},
        # the results in call order, then the next user text, in one user message
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_a", "content": "ping"},
            {"type": "tool_result", "tool_use_id": "toolu_b",
             "content": "timeout: took longer than 5 s", "is_error": True},
            {"type": "tool_result", "tool_use_id": "toolu_c", "content":
             "error: this call did not run (see the protocol errors in the next message)",
             "is_error": True},
            {"type": "tool_result", "tool_use_id": "toolu_d"},
            {"type": "text", "text": "<protocol_errors>...</protocol_errors>"},
            {"type": "text", "text": "Go on."}]},
    ]
    assert request["tools"] == [
        {"name": "echo", "description": "Echo a message back.",
         "input_schema": TOOLS[0]["function"]["parameters"], "eager_input_streaming": True},
        {"name": "calculator", "input_schema": TOOLS[1]["function"]["parameters"],
         "eager_input_streaming": True},
    ]
    sdk_request({"model": "m", "max_tokens": 1, "stream": True, **request})


def test_error_statuses_are_the_result_statuses_other_than_ok() -> None:
    assert set(ERROR_STATUSES) == set(RESULT_STATUSES) - {"ok"}
    for status in ERROR_STATUSES:
        (block,) = to_messages_request([{"role": "tool", "tool_call_id": "t",
                                         "content": f"{status}: why"}])["messages"][0]["content"]
        assert block["is_error"] is True
    (ok,) = to_messages_request([{"role": "tool", "tool_call_id": "t",
                                  "content": "errors: none"}])["messages"][0]["content"]
    assert "is_error" not in ok


def test_what_cannot_be_sent_is_a_clear_final_error() -> None:
    with pytest.raises(ModelError, match="'image_url'") as info:
        to_messages_request([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert not info.value.retryable
    with pytest.raises(ModelError, match="role 'function'"):
        to_messages_request([{"role": "function", "content": "x"}])


# -- the request ---------------------------------------------------------------------------------
def test_the_request_is_a_messages_api_request(
        api: FakeAnthropic, model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    api.script(model, [Turn(text="ok"), Turn(text="ok")])
    monkeypatch.setenv("FAKE_ANTHROPIC_KEY", "sk-ant-test")
    cfg = config(api, model, api_key_env="FAKE_ANTHROPIC_KEY", temperature=0.2, max_tokens=256)
    assert text_of(list(stream_messages(cfg, MESSAGES, tools=TOOLS))) == "ok"
    assert text_of(list(stream_messages(config(api, model), MESSAGES))) == "ok"
    first, second = api.requests(model)
    assert first["model"] == model and first["stream"] is True
    assert first["system"] == "You are terse."
    assert first["messages"] == [{"role": "user", "content": [{"type": "text",
                                                                "text": "Say hello."}]}]
    assert first["max_tokens"] == 256 and first["temperature"] == 0.2
    assert [t["name"] for t in first["tools"]] == ["echo", "calculator"]
    assert all(t["eager_input_streaming"] is True for t in first["tools"])
    assert second["max_tokens"] == DEFAULT_MAX_TOKENS
    assert not {"temperature", "tools"} & set(second)
    headers = api.request_headers(model)
    assert headers[0]["x-api-key"] == "sk-ant-test"
    assert headers[0]["anthropic-version"] == "2023-06-01"
    assert headers[0]["content-type"] == "application/json"
    assert "x-api-key" not in headers[1] and "authorization" not in headers[1]
    for body in (first, second):
        sdk_request(body)


def test_anthropic_config_defaults() -> None:
    cfg = ModelConfig(provider="anthropic")
    assert cfg.base_url == "https://api.anthropic.com/v1"
    assert cfg.api_key_env == "ANTHROPIC_API_KEY" and cfg.model.startswith("claude-")
    keyless = ModelConfig(provider="anthropic", api_key_env=None, model="claude-x",
                          base_url="http://127.0.0.1:1/v1")
    assert (keyless.api_key_env, keyless.model, keyless.base_url) == (
        None, "claude-x", "http://127.0.0.1:1/v1")
    assert ModelConfig().api_key_env == "OPENAI_API_KEY"  # openai's defaults are untouched
    assert ModelConfig(provider="anthropic", temperature=1).temperature == 1
    with pytest.raises(ValueError, match="from 0 to 1"):
        ModelConfig(provider="anthropic", temperature=1.5)
    assert set(get_args(ModelConfig.model_fields["provider"].annotation)) == set(
        gateway.PROVIDERS)


# -- streaming -----------------------------------------------------------------------------------
def test_a_models_requests_share_one_kept_alive_connection(model: str) -> None:
    """Turns, retries and errors reach the Messages API over one connection."""
    with FakeAnthropic() as server:
        server.script(model, [
            Turn(text="one"),
            Turn(fail_status=529), Turn(text="two"),
            Turn(tool_calls=[{"id": "toolu_1", "name": "lookup", "arguments": {"k": 1}}]),
            Turn(fail_status=400, error_message="no"),
            Turn(text="three")])
        cfg = config(server, model, max_retries=1)
        assert text_of(list(stream_messages(cfg, MESSAGES))) == "one"
        assert text_of(list(stream_messages(cfg, MESSAGES))) == "two"
        # read to its end: a stream closed early (at its call) may leave its connection
        assert any(isinstance(piece, ToolCall) for piece in list(stream_messages(cfg, MESSAGES)))
        assert failure(stream_messages(cfg, MESSAGES)).status == 400
        assert text_of(list(stream_messages(cfg, MESSAGES))) == "three"
        assert len(server.requests(model)) == 6
        assert server.connections == 1


def test_text_deltas_arrive_as_streamed_and_thinking_is_not_text(
        api: FakeAnthropic, model: str) -> None:
    text = '<thought>Hi — "quoted" & <b>raw</b>\n</thought><response>Hello!</response>'
    api.script(model, [Turn(text=text, chunk_chars=3, thinking="Let me think.")])
    pieces = list(stream_messages(config(api, model), MESSAGES))
    deltas = [piece for piece in pieces if isinstance(piece, TextDelta)]
    assert text_of(pieces) == text
    assert len(deltas) == -(-len(text) // 3)  # one delta per server event
    assert isinstance(pieces[-1], Usage)
    assert settled(api, model) == ["complete"]


def test_text_is_yielded_while_the_model_is_still_writing(api: FakeAnthropic, model: str) -> None:
    """Not buffered until the end: the server holds its stream after the text block until
    the test has seen the text, and the message's end was not sent by then."""
    text_done = threading.Event()
    api.script(model, [Turn(text="x" * 200, chunk_chars=4, holds={0: text_done})])
    sent_when_seen: list[dict[str, Any]] = []
    for piece in stream_messages(config(api, model), MESSAGES):
        if isinstance(piece, TextDelta) and not text_done.is_set():
            sent_when_seen.append(api.events(model)[0][-1])
            text_done.set()
    assert sent_when_seen[0]["type"] in {"content_block_delta", "content_block_stop"}
    assert [e["type"] for e in api.events(model)[0]][-1] == "message_stop"


def test_tool_use_blocks_are_assembled_from_input_json_deltas(
        api: FakeAnthropic, model: str) -> None:
    calls = [
        {"id": "toolu_a1", "name": "calculator", "arguments": {"expression": "2 ** 10 + 3"}},
        {"id": "toolu_b2", "name": "echo", "arguments": {"message": {"nested": [1, 2, "x"]}}},
        {"id": "toolu_c3", "name": "list_context_feeds", "arguments": ""},
    ]
    api.script(model, [Turn(text="<thought>calling</thought>", tool_calls=calls, chunk_chars=3)])
    pieces = list(stream_messages(config(api, model), MESSAGES))
    assert [piece for piece in pieces if isinstance(piece, ToolCall)] == [
        ToolCall("toolu_a1", "calculator", {"expression": "2 ** 10 + 3"},
                 '{"expression": "2 ** 10 + 3"}'),
        ToolCall("toolu_b2", "echo", {"message": {"nested": [1, 2, "x"]}},
                 '{"message": {"nested": [1, 2, "x"]}}'),
        ToolCall("toolu_c3", "list_context_feeds", {}, ""),
    ]
    kinds = [type(piece).__name__ for piece in pieces]
    assert kinds.index("ToolCall") > max(i for i, k in enumerate(kinds) if k == "TextDelta")
    assert kinds[-1] == "Usage"


def test_each_tool_use_is_yielded_at_its_content_block_stop(
        api: FakeAnthropic, model: str) -> None:
    """A call is complete at its block's end: it can run while the model streams the next
    block, instead of waiting for the end of the message. The server holds its stream after
    each call's `content_block_stop` until the test has seen that call, and the test notes
    what the server had sent when it saw it."""
    calls = [{"id": "toolu_1", "name": "echo", "arguments": {"message": "first"}},
             {"id": "toolu_2", "name": "echo", "arguments": {"message": "x" * 200}}]
    holds = {0: threading.Event(), 1: threading.Event()}
    api.script(model, [Turn(tool_calls=calls, chunk_chars=4, tokens_per_second=2000,
                            holds=holds)])
    seen: list[tuple[ToolCall, dict[str, Any]]] = []
    for piece in stream_messages(config(api, model), MESSAGES):
        if isinstance(piece, ToolCall):
            (sent,) = api.events(model)
            seen.append((piece, sent[-1]))
            holds[len(seen) - 1].set()
    (first, first_sent), (second, second_sent) = seen
    assert (first.id, second.id) == ("toolu_1", "toolu_2")
    assert first.arguments == {"message": "first"}
    # yielded before any of the second block was sent
    assert first_sent == {"type": "content_block_stop", "index": 0}
    assert second.arguments == {"message": "x" * 200}
    # and the second at its own block's end, before the message's end
    assert second_sent == {"type": "content_block_stop", "index": 1}
    assert settled(api, model) == ["complete"]


@pytest.mark.parametrize("raw", ['{"message": "unterminated', '{"message": "hi" "oops": 1}',
                                 "[1, 2]"])
def test_partial_or_invalid_input_json_is_a_call_without_arguments(
        api: FakeAnthropic, model: str, raw: str) -> None:
    """Fine-grained tool streaming sends the input unvalidated: a bad one is reported to the
    model as a protocol error, never a crash."""
    api.script(model, [Turn(tool_calls=[{"id": "toolu_bad", "name": "echo", "arguments": raw},
                                        {"id": "toolu_ok", "name": "echo",
                                         "arguments": {"message": "fine"}}])])
    calls = [p for p in stream_messages(config(api, model), MESSAGES) if isinstance(p, ToolCall)]
    assert calls == [ToolCall("toolu_bad", "echo", None, raw),
                     ToolCall("toolu_ok", "echo", {"message": "fine"}, '{"message": "fine"}')]
    events = parse_document(tool_call_to_protocol(calls[0]))
    assert [e.data["kind"] for e in events if e.type == p.PROTOCOL_ERROR] == ["invalid_json"]


def test_a_tool_use_cut_by_max_tokens_is_still_reported(api: FakeAnthropic, model: str) -> None:
    lines = [
        'event: message_start', 'data: {"type": "message_start", "message": {"id": "m", '
        '"type": "message", "role": "assistant", "model": "x", "content": [], '
        '"stop_reason": null, "stop_sequence": null, '
        '"usage": {"input_tokens": 5, "output_tokens": 1}}}', '',
        'event: content_block_start', 'data: {"type": "content_block_start", "index": 0, '
        '"content_block": {"type": "tool_use", "id": "toolu_x", "name": "echo", "input": {}}}',
        '', 'event: content_block_delta', 'data: {"type": "content_block_delta", "index": 0, '
        '"delta": {"type": "input_json_delta", "partial_json": "{\\"message\\": \\"cu"}}', '',
        'event: message_delta', 'data: {"type": "message_delta", "delta": {"stop_reason": '
        '"max_tokens", "stop_sequence": null}, "usage": {"output_tokens": 7}}', '',
        'event: message_stop', 'data: {"type": "message_stop"}', '']
    assert list(decode_lines(MessagesDecoder("u"), iter(lines))) == [
        ToolCall("toolu_x", "echo", None, '{"message": "cu'), Usage(5, 7, 12)]


def test_usage_counts_cache_tokens_as_prompt_tokens(api: FakeAnthropic, model: str) -> None:
    api.script(model, [Turn(text="x" * 40, cache_read_tokens=100, cache_creation_tokens=20),
                       Turn(text="y" * 40)])
    usage = list(stream_messages(config(api, model), MESSAGES))[-1]
    start = api.events(model)[0][0]["message"]["usage"]
    assert isinstance(usage, Usage)
    assert usage.prompt_tokens == start["input_tokens"] + 120 and start["input_tokens"] > 0
    assert usage.completion_tokens == 10  # message_delta's output_tokens, not message_start's 1
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    plain = list(stream_messages(config(api, model), MESSAGES))[-1]
    assert isinstance(plain, Usage) and plain.prompt_tokens == start["input_tokens"]


# -- retries and errors --------------------------------------------------------------------------
def test_429_is_retried_honouring_retry_after(api: FakeAnthropic, model: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait before the retry is the `Retry-After` (plus at most 50 ms of jitter)."""
    slept: list[float] = []
    monkeypatch.setattr(transport, "_sleep", slept.append)
    api.script(model, [Turn(fail_status=429, headers={"Retry-After": "1"},
                            error_message="Number of request tokens has exceeded your limit"),
                       Turn(text="ok")])
    assert text_of(list(stream_messages(config(api, model), MESSAGES))) == "ok"
    assert len(api.requests(model)) == 2
    (wait,) = slept
    assert 1.0 <= wait <= 1.05
    assert settled(api, model) == ["failed", "complete"]


def test_529_overloaded_is_retried(api: FakeAnthropic, model: str) -> None:
    api.script(model, [Turn(fail_status=529, error_message="Overloaded"),
                       Turn(fail_status=500, error_message="Internal server error"),
                       Turn(text="third time lucky")])
    assert text_of(list(stream_messages(config(api, model), MESSAGES))) == "third time lucky"
    assert settled(api, model) == ["failed", "failed", "complete"]


def test_retries_are_bounded_and_say_how_many_were_made(api: FakeAnthropic, model: str) -> None:
    api.script(model, [Turn(fail_status=529, error_message="Overloaded")] * 3)
    error = failure(stream_messages(config(api, model, max_retries=2), MESSAGES))
    assert error.retryable and error.status == 529 and error.streamed == 0
    assert error.attempts == 3 and len(api.requests(model)) == 3
    assert "HTTP 529: Overloaded" in str(error)
    assert "(3 attempts made; max_retries is 2)" in str(error)


def test_a_400_is_not_retried_and_carries_the_apis_message(api: FakeAnthropic, model: str) -> None:
    message = "messages.1.content.0.tool_result: unexpected tool_use_id found"
    api.script(model, [Turn(fail_status=400, error_message=message), Turn(text="never")])
    error = failure(stream_messages(config(api, model), MESSAGES))
    assert not error.retryable and error.status == 400 and error.attempts == 1
    assert f"HTTP 400: {message}" in str(error) and "attempt" not in str(error)
    assert len(api.requests(model)) == 1


def test_a_401_says_which_key_to_fix(api: FakeAnthropic, model: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    api.script(model, [Turn(fail_status=401, error_message="invalid x-api-key")])
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-wrong")
    cfg = ModelConfig(provider="anthropic", base_url=api.url, model=model)
    error = failure(stream_messages(cfg, MESSAGES))
    assert not error.retryable and "invalid x-api-key" in str(error)
    assert "ANTHROPIC_API_KEY" in str(error)


def test_a_missing_key_fails_at_once_naming_its_variable(
        api: FakeAnthropic, model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    api.script(model, [Turn(text="never")])
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    cfg = ModelConfig(provider="anthropic", base_url=api.url, model=model)  # its default name
    error = failure(stream_messages(cfg, MESSAGES))
    assert (error.retryable, error.status, error.attempts) == (False, None, 1)
    assert "environment variable ANTHROPIC_API_KEY (api_key_env) is not set" in str(error)
    assert api.requests(model) == []


def test_a_drop_after_output_is_raised_retryable_with_what_was_streamed(
        api: FakeAnthropic, model: str) -> None:
    api.script(model, [Turn(text="<thought>" + "a" * 100, fail_after_chars=30),
                       Turn(text="never")])
    seen: list[str] = []
    with pytest.raises(ModelError) as info:
        for piece in stream_messages(config(api, model), MESSAGES):
            seen.append(piece.text)
    assert info.value.retryable and info.value.streamed == len("".join(seen)) == 30
    assert len(api.requests(model)) == 1 and settled(api, model) == ["dropped"]


def test_a_drop_before_any_output_is_retried(api: FakeAnthropic, model: str) -> None:
    api.script(model, [Turn(text="lost", fail_after_chars=0), Turn(text="found")])
    assert text_of(list(stream_messages(config(api, model), MESSAGES))) == "found"
    assert settled(api, model) == ["dropped", "complete"]


def test_an_error_event_mid_stream(api: FakeAnthropic, model: str) -> None:
    overloaded = {"type": "overloaded_error", "message": "Overloaded"}
    # after output: raised, retryable, with what was streamed
    api.script(model, [Turn(text="partial", stream_error=overloaded), Turn(text="never")])
    error = failure(stream_messages(config(api, model), MESSAGES))
    assert error.retryable and error.streamed == len("partial") and error.status == 529
    assert "mid-stream: overloaded_error: Overloaded" in str(error)
    assert len(api.requests(model)) == 1
    # before any output: retried like a 529
    other = f"{model}-clean"
    api.script(other, [Turn(stream_error=overloaded), Turn(text="recovered")])
    assert text_of(list(stream_messages(config(api, other), MESSAGES))) == "recovered"
    # a client error is final
    final = f"{model}-final"
    api.script(final, [Turn(stream_error={"type": "invalid_request_error",
                                          "message": "prompt is too long"})])
    error = failure(stream_messages(config(api, final), MESSAGES))
    assert not error.retryable and "prompt is too long" in str(error)


def test_a_stream_that_ends_before_the_message_does_is_retryable() -> None:
    lines = ['event: message_start', 'data: {"type": "message_start", "message": {"usage": '
             '{"input_tokens": 1}}}', '', 'event: content_block_delta',
             'data: {"type": "content_block_delta", "index": 0, '
             '"delta": {"type": "text_delta", "text": "a"}}', '']
    with pytest.raises(ModelError, match="before the message finished") as info:
        list(decode_lines(MessagesDecoder("u"), iter(lines)))
    assert info.value.retryable
    with pytest.raises(ModelError, match="not JSON"):
        list(decode_lines(MessagesDecoder("u"), iter(["event: message_start", "data: {oops", ""])))


def test_closing_the_generator_closes_the_connection(api: FakeAnthropic, model: str) -> None:
    api.script(model, [Turn(text="z" * 4000, tokens_per_second=40)])  # 25 s if read to the end
    gen = stream_messages(config(api, model), MESSAGES)
    assert isinstance(next(gen), TextDelta) and isinstance(next(gen), TextDelta)
    gen.close()
    written = len(api.stream_log(model)[0])  # text deltas the server had written by then
    # the server's next write found the connection closed: it records the disconnect, having
    # written at most the delta in flight and one more, not the rest of the text's 1000
    assert settled(api, model) == ["client_disconnected"]
    assert len(api.stream_log(model)[0]) <= written + 2 < 1000


def test_a_stall_mid_stream_times_out_with_the_streamed_count(
        api: FakeAnthropic, model: str) -> None:
    api.script(model, [Turn(text="abcdefgh" * 4, tokens_per_second=1)])  # 1 s between deltas
    error = failure(stream_messages(config(api, model, timeout_s=0.3), MESSAGES))
    assert error.retryable and error.streamed == 4 and "timeout_s" in str(error)
    assert len(api.requests(model)) == 1


def test_an_unreachable_endpoint_is_retryable_and_says_so(model: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = ModelConfig(provider="anthropic", base_url=f"http://127.0.0.1:{port}/v1", model=model,
                      api_key_env=None, max_retries=1)
    error = failure(stream_messages(cfg, MESSAGES))
    assert error.retryable and "could not be reached" in str(error) and error.attempts == 2


def test_a_server_that_answers_a_whole_message_still_works(model: str) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/messages"
        return httpx.Response(200, json={
            "id": "msg_1", "type": "message", "role": "assistant", "model": model,
            "stop_reason": "tool_use", "stop_sequence": None,
            "content": [{"type": "text", "text": "whole"},
                        {"type": "tool_use", "id": "toolu_1", "name": "echo",
                         "input": {"message": 1}}],
            "usage": {"input_tokens": 3, "output_tokens": 2}})

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        cfg = ModelConfig(provider="anthropic", base_url="http://llm.test/v1", model=model,
                          api_key_env=None)
        assert list(stream_messages(cfg, MESSAGES, client=client)) == [
            TextDelta("whole"), ToolCall("toolu_1", "echo", {"message": 1}, '{"message": 1}'),
            Usage(3, 2, 5)]


# -- the provider table ----------------------------------------------------------------------------
def test_open_stream_and_complete_dispatch_to_the_messages_api(
        api: FakeAnthropic, model: str) -> None:
    api.script(model, [Turn(text="streamed", tool_calls=[
        {"id": "toolu_1", "name": "echo", "arguments": {"message": "m"}}]),
        Turn(text="partial answer", fail_after_chars=5), Turn(text="the whole answer")])
    pieces = list(gateway.open_stream(config(api, model), MESSAGES, TOOLS))
    assert text_of(pieces) == "streamed"
    assert ToolCall("toolu_1", "echo", {"message": "m"}, '{"message": "m"}') in pieces
    text, usage = gateway.complete(config(api, model), MESSAGES)
    assert text == "the whole answer" and usage is not None and usage.completion_tokens == 4
    assert settled(api, model) == ["complete", "dropped", "complete"]
    assert all(r["max_tokens"] == DEFAULT_MAX_TOKENS for r in api.requests(model))


# -- the fake server against the official SDK ------------------------------------------------------
def test_every_event_the_fake_sends_is_valid_for_the_sdk(api: FakeAnthropic, model: str) -> None:
    api.script(model, [
        Turn(text="Hello", thinking="Hmm.", cache_read_tokens=3, cache_creation_tokens=2,
             tool_calls=[{"id": "toolu_1", "name": "echo", "arguments": {"message": "x"}},
                         {"id": "toolu_2", "name": "echo", "arguments": '{"message": "cut'}]),
        Turn(text="usage off", usage=False),
        Turn(text="broken", stream_error={"type": "overloaded_error", "message": "Overloaded"}),
        Turn(text="never", stream_error={"type": "api_error", "message": "boom"}),
    ])
    list(stream_messages(config(api, model), MESSAGES, tools=TOOLS))
    list(stream_messages(config(api, model), MESSAGES))
    failure(stream_messages(config(api, model), MESSAGES))
    events = api.events(model)
    assert [e["type"] for e in events[0]] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop",  # thinking (one delta of 4 characters, then the signature)
        "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop",  # text
        "content_block_start", *["content_block_delta"] * 4, "content_block_stop",  # toolu_1: 16 chars
        "content_block_start", *["content_block_delta"] * 4, "content_block_stop",  # toolu_2
        "message_delta", "message_stop"]
    assert events[2][-1]["type"] == "error"
    for sent in events:
        for payload in sent:
            sdk_event(payload)
    for status, kind in ERROR_TYPES.items():
        if status == 413:
            continue  # request_too_large has no error object type in the SDK
        other = f"{model}-{status}"
        api.script(other, [Turn(fail_status=status, error_message=f"failed with {status}")])
        response = httpx.post(f"{api.url}/messages", headers={"anthropic-version": "2023-06-01"},
                              json={"model": other, "max_tokens": 5, "messages": []})
        assert response.status_code == status
        error = _ERROR.validate_python(response.json())
        no_extras(error)
        assert (error.error.type, error.error.message) == (kind, f"failed with {status}")


def test_the_fake_checks_requests_as_the_api_does(api: FakeAnthropic, model: str) -> None:
    api.script(model, [Turn(text="unused")])
    body = {"model": model, "max_tokens": 5, "messages": []}
    unversioned = httpx.post(f"{api.url}/messages", json=body)
    assert unversioned.status_code == 400 and "anthropic-version" in unversioned.text
    versioned = {"anthropic-version": "2023-06-01"}
    limitless = httpx.post(f"{api.url}/messages", json={**body, "max_tokens": None},
                           headers=versioned)
    assert limitless.status_code == 400 and "max_tokens" in limitless.text
    assert api.remaining(model) == 1  # a refused request uses no turn
    assert api.outcomes(model) == ["invalid", "invalid"]


def test_the_official_sdk_reads_the_fake_servers_stream(api: FakeAnthropic, model: str) -> None:
    api.script(model, [
        Turn(text="Let me check.", cache_read_tokens=7,
             tool_calls=[{"id": "toolu_1", "name": "echo", "arguments": {"message": "hi"}},
                         {"id": "toolu_2", "name": "calculator",
                          "arguments": {"expression": "6*7"}}]),
        Turn(fail_status=529, error_message="Overloaded"),
    ])
    client = anthropic_sdk.Anthropic(base_url=api.root_url, api_key="sk-ant-test", max_retries=0)
    try:
        with client.messages.stream(model=model, max_tokens=100, system="Be brief.",
                                    messages=[{"role": "user", "content": "Hi"}],
                                    tools=[{"name": "echo", "input_schema": {"type": "object"},
                                            "eager_input_streaming": True}]) as stream:
            deltas = list(stream.text_stream)
            message = stream.get_final_message()
        assert "".join(deltas) == "Let me check."
        assert [b.type for b in message.content] == ["text", "tool_use", "tool_use"]
        assert [(b.id, b.name, b.input) for b in message.content[1:]] == [
            ("toolu_1", "echo", {"message": "hi"}), ("toolu_2", "calculator",
                                                     {"expression": "6*7"})]
        assert message.stop_reason == "tool_use"
        assert message.usage.cache_read_input_tokens == 7
        assert message.usage.output_tokens > 1
        with pytest.raises(anthropic_sdk.APIStatusError) as info:
            client.messages.create(model=model, max_tokens=10,
                                   messages=[{"role": "user", "content": "Hi"}])
        assert info.value.status_code == 529 and "Overloaded" in str(info.value)
    finally:
        client.close()
    sent = api.requests(model)[0]
    assert sent["system"] == "Be brief." and sent["stream"] is True
    assert json.loads(json.dumps(sent["tools"]))[0]["eager_input_streaming"] is True
