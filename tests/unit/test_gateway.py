"""The model gateway (cortex_worker.llm.gateway) against a real HTTP server (tests.fake_llm),
and the stream types (cortex_worker.llm.stream)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cortex_worker.llm import gateway, transport
from cortex_worker.llm.config import ModelConfig
from cortex_worker.llm.sse import decode_lines
from cortex_worker.llm.stream import (
    ModelError,
    TextDelta,
    ToolCall,
    Usage,
    protocol_id,
    tool_call_to_protocol,
)
from cortex_worker.protocol import parser as p
from cortex_worker.protocol.parser import parse_document
from tests.fake_llm import FakeLLM, Turn


def settled(llm: FakeLLM, model: str, timeout: float = 5.0) -> list[str]:
    """The server's outcomes once none is still `streaming` (it records them a moment after
    the client has read the last byte)."""
    deadline = time.monotonic() + timeout
    while "streaming" in llm.outcomes(model) and time.monotonic() < deadline:
        time.sleep(0.01)
    return llm.outcomes(model)

pytestmark = pytest.mark.unit

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def llm() -> Iterator[FakeLLM]:
    with FakeLLM() as server:
        yield server


@pytest.fixture
def model(request: pytest.FixtureRequest) -> str:
    """A model name of its own for each test, so scripts never mix."""
    return request.node.name


def config(llm: FakeLLM, model: str, **overrides: Any) -> ModelConfig:
    return ModelConfig(base_url=llm.url, model=model, api_key_env=None, **overrides)


def text_of(pieces: list[Any]) -> str:
    return "".join(piece.text for piece in pieces if isinstance(piece, TextDelta))


def failure(gen: Iterator[Any]) -> ModelError:
    with pytest.raises(ModelError) as info:
        for _ in gen:
            pass
    return info.value


# -- streaming ----------------------------------------------------------------------------------
def test_text_deltas_join_to_the_script_and_the_request_is_openai_shaped(
        llm: FakeLLM, model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    text = '<thought>Hi — "quoted" & <b>raw</b>\n</thought><response>Hello!</response>'
    llm.script(model, [Turn(text=text, chunk_chars=3)])
    monkeypatch.setenv("FAKE_LLM_KEY", "sk-test")
    tools = [{"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}]
    cfg = ModelConfig(base_url=llm.url, model=model, api_key_env="FAKE_LLM_KEY",
                      temperature=0.2, max_tokens=256)
    pieces = list(gateway.stream_chat(cfg, MESSAGES, tools=tools))
    deltas = [piece for piece in pieces if isinstance(piece, TextDelta)]
    assert text_of(pieces) == text
    assert len(deltas) == -(-len(text) // 3)  # one delta per server chunk
    (body,) = llm.requests(model)
    assert body["messages"] == MESSAGES and body["model"] == model
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.2 and body["max_tokens"] == 256 and body["tools"] == tools
    assert llm.request_headers(model)[0]["authorization"] == "Bearer sk-test"
    assert settled(llm, model) == ["complete"]


def test_optional_fields_are_left_out(llm: FakeLLM, model: str) -> None:
    llm.script(model, [Turn(text="ok")])
    assert text_of(list(gateway.stream_chat(config(llm, model), MESSAGES))) == "ok"
    (body,) = llm.requests(model)
    assert not {"temperature", "max_tokens", "tools"} & set(body)
    assert "authorization" not in llm.request_headers(model)[0]


def test_tool_calls_are_assembled_from_fragments(llm: FakeLLM, model: str) -> None:
    calls = [
        {"id": "call_a1", "name": "calculator", "arguments": {"expression": "2 ** 10 + 3"}},
        {"id": "call_b2", "name": "echo", "arguments": {"message": {"nested": [1, 2, "x"]}}},
        {"id": "call_c3", "name": "echo", "arguments": '{"message": "unterminated'},
        {"id": "call_d4", "name": "list_context_feeds", "arguments": ""},
    ]
    llm.script(model, [Turn(text="<thought>calling</thought>", tool_calls=calls, chunk_chars=3)])
    pieces = list(gateway.stream_chat(config(llm, model), MESSAGES))
    got = [piece for piece in pieces if isinstance(piece, ToolCall)]
    assert got == [
        ToolCall("call_a1", "calculator", {"expression": "2 ** 10 + 3"},
                 '{"expression": "2 ** 10 + 3"}'),
        ToolCall("call_b2", "echo", {"message": {"nested": [1, 2, "x"]}},
                 '{"message": {"nested": [1, 2, "x"]}}'),
        ToolCall("call_c3", "echo", None, '{"message": "unterminated'),
        ToolCall("call_d4", "list_context_feeds", {}, ""),
    ]
    # text first, then the calls, then usage last
    kinds = [type(piece).__name__ for piece in pieces]
    assert kinds.index("ToolCall") > max(i for i, k in enumerate(kinds) if k == "TextDelta")
    assert kinds[-1] == "Usage"


def held_calls(llm: FakeLLM, model: str, holds: dict[int, threading.Event]
               ) -> list[tuple[ToolCall, int]]:
    """Each tool call the gateway yields, with how many tokens the server had written when
    it was yielded; each yield releases the next of `holds` (by token number)."""
    waiting = [holds[token] for token in sorted(holds)]
    seen: list[tuple[ToolCall, int]] = []
    for piece in gateway.stream_chat(config(llm, model), MESSAGES):
        if isinstance(piece, ToolCall):
            seen.append((piece, len(llm.token_times(model)[0])))
            if waiting:
                waiting.pop(0).set()
    return seen


def argument_tokens(call: dict[str, Any], size: int = 4) -> int:
    return -(-len(json.dumps(call["arguments"])) // size)


def test_each_tool_call_is_yielded_once_the_next_one_starts(llm: FakeLLM, model: str) -> None:
    """A call is complete when a later index starts: it can run while the model streams the
    next one, instead of waiting for the end of the message. The server holds its stream
    once the second call has begun until the first was yielded."""
    calls = [{"id": "call_1", "name": "echo", "arguments": {"message": "first"}},
             {"id": "call_2", "name": "echo", "arguments": {"message": "x" * 200}}]
    second_head = 1 + argument_tokens(calls[0])  # token 0: the first call's head
    holds = {second_head: threading.Event()}
    llm.script(model, [Turn(tool_calls=calls, chunk_chars=4, tokens_per_second=2000, holds=holds)])
    (first, written), (second, _) = held_calls(llm, model, holds)
    assert (first.id, second.id) == ("call_1", "call_2")
    assert first.arguments == {"message": "first"}
    # yielded while the second call was still streaming: at most its head was written
    assert written <= second_head + 1 < 2 + argument_tokens(calls[0]) + argument_tokens(calls[1])
    assert second.arguments == {"message": "x" * 200}
    assert len(llm.token_times(model)[0]) == 2 + argument_tokens(calls[0]) + argument_tokens(calls[1])


def test_a_tool_call_is_yielded_the_moment_its_arguments_close(llm: FakeLLM,
                                                              model: str) -> None:
    """Its last argument fragment completes a call: it runs before the model has begun the
    next one (a real model writes the next call's name first, or its end-of-message). The
    server holds its stream after that fragment until the call was yielded."""
    calls = [{"id": "call_1", "name": "echo", "arguments": {"message": "first"}},
             {"id": "call_2", "name": "echo", "arguments": {"message": "second"}}]
    last_fragment = argument_tokens(calls[0])  # tick 0: the call's head
    holds = {last_fragment: threading.Event()}
    llm.script(model, [Turn(tool_calls=calls, chunk_chars=4, tokens_per_second=2000, holds=holds)])
    seen = held_calls(llm, model, holds)
    (first, written), (second, _) = seen
    assert (first.id, second.id) == ("call_1", "call_2")
    assert written == last_fragment + 1  # nothing of the next call was written yet


def test_the_last_call_runs_before_the_message_ends(llm: FakeLLM, model: str) -> None:
    """An engine ends a message a token after its last chunk (the model's end-of-turn token):
    the message's last call is yielded at its last argument fragment, before that end. The
    server holds its stream after that fragment until the call was yielded."""
    calls = [{"id": "call_1", "name": "echo", "arguments": {"message": "only"}}]
    last_fragment = argument_tokens(calls[0])
    holds = {last_fragment: threading.Event()}
    llm.script(model, [Turn(tool_calls=calls, tokens_per_second=2000, end_token=True,
                            holds=holds)])
    ((call, written),) = held_calls(llm, model, holds)
    assert call.id == "call_1"
    assert written == last_fragment + 1  # the end-of-turn token was not written yet
    assert len(llm.token_times(model)[0]) == 1 + argument_tokens(calls[0]) + 1


def chunk(*fragments: dict[str, Any], finish: str | None = None) -> str:
    """One `chat.completion.chunk`'s data carrying tool-call fragments."""
    delta = {"tool_calls": list(fragments)} if fragments else {}
    return json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def fragment(index: int, arguments: str, name: str = "") -> dict[str, Any]:
    head = {"id": f"call_{index}", "name": name} if name else {}
    return {"index": index, **({"id": head["id"]} if head else {}),
            "function": {**({"name": name} if name else {}), "arguments": arguments}}


def decode(*events: str) -> list[list[Any]]:
    """The pieces each event gives, through the decoder the gateway uses."""
    decoder = gateway.ChatDecoder("http://model")
    return [decoder.event("", data) for data in events] + [decoder.end()]


def test_a_calls_arguments_close_where_their_outermost_object_does() -> None:
    """Braces and quotes inside strings, escapes split across fragments and nested objects do
    not close the arguments early; the fragment that does close them yields the call."""
    text = json.dumps({"a": '}{\\"', "b": {"c": [1, {"d": "\\"}]}, "e": "x\\"})
    value = json.loads(text)
    for size in (1, 2, 3, 5, len(text)):
        parts = [text[i:i + size] for i in range(0, len(text), size)]
        events = [chunk(fragment(0, "", name="echo"))]
        events += [chunk(fragment(0, part)) for part in parts]
        got = decode(*events, chunk(finish="tool_calls"))
        assert [i for i, pieces in enumerate(got) if pieces] == [len(parts)], size
        assert got[len(parts)] == [ToolCall("call_0", "echo", value, text)]


def test_arguments_that_do_not_close_as_json_wait_for_the_end() -> None:
    """Balanced braces that are not JSON, or arguments that are not an object, are complete
    only at the end of the message, and reported as the model wrote them."""
    for text in ('{"a": tru}', '[{"a": 1}]', '"x"'):
        got = decode(chunk(fragment(0, "", name="echo")), chunk(fragment(0, text)),
                     chunk(fragment(0, " ")), chunk(finish="tool_calls"))
        assert got[:3] == [[], [], []]
        assert got[3] == [ToolCall("call_0", "echo", None, text + " ")]


def test_an_object_sent_whole_is_a_complete_call() -> None:
    got = decode(chunk({"index": 0, "id": "c", "function": {"name": "echo",
                                                            "arguments": {"m": 1}}}),
                 chunk(finish="tool_calls"))
    assert got[0] == [ToolCall("c", "echo", {"m": 1}, '{"m": 1}')]


def test_the_same_arguments_sent_twice_are_one_call(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's xlam parser has sent a call's arguments twice (`{..}{..}`): the call runs once,
    as soon as the first copy closes."""
    got = decode(chunk(fragment(0, "", name="echo")), chunk(fragment(0, '{"m": 1}{"m"')),
                 chunk(fragment(0, ': 1}')), chunk(fragment(1, '{}', name="echo")),
                 chunk(finish="tool_calls"))
    assert got[1] == [ToolCall("call_0", "echo", {"m": 1}, '{"m": 1}')]
    assert got[2] == [] and got[4] == [ToolCall("call_1", "echo", {}, "{}")]
    assert got[3] == got[5] == [] and not caplog.text


def test_an_empty_object_before_the_arguments_is_a_placeholder() -> None:
    """Gemini's OpenAI-compatible endpoint sends `{}` first, then the arguments: the call
    runs with the arguments; a `{}` with nothing after it is a call without arguments."""
    got = decode(chunk(fragment(0, "{}", name="echo")), chunk(fragment(0, '{"m": 1}')),
                 chunk(fragment(1, "{}", name="echo")), chunk(finish="tool_calls"))
    assert got == [[], [ToolCall("call_0", "echo", {"m": 1}, '{"m": 1}')],
                   [], [ToolCall("call_1", "echo", {}, "{}")], []]


def test_objects_run_together_are_calls_of_their_own() -> None:
    """Gemini has sent parallel calls of one function as one call whose arguments are the
    objects run together: each object is a call, with an id of its own."""
    got = decode(chunk(fragment(0, '{"m": 1}{"m": 2}', name="echo")),
                 chunk(fragment(0, ' {"m": 3}')), chunk(finish="tool_calls"))
    assert got == [[ToolCall("call_0", "echo", {"m": 1}, '{"m": 1}'),
                    ToolCall("call_0_2", "echo", {"m": 2}, '{"m": 2}')],
                   [ToolCall("call_0_3", "echo", {"m": 3}, '{"m": 3}')], [], []]


def test_text_after_a_calls_arguments_that_is_no_object_is_dropped_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    got = decode(chunk(fragment(0, '{"m": 1}, "x"', name="echo")), chunk(finish="tool_calls"))
    assert got == [[ToolCall("call_0", "echo", {"m": 1}, '{"m": 1}')], [], []]
    assert 'call_0' in caplog.text and ', "x"' in caplog.text


def test_calls_that_all_come_as_index_0_are_told_apart_by_their_ids() -> None:
    """Ollama sends every call of a message as index 0, each with its own id: each is a call
    of its own, whole in one chunk or streamed in fragments."""
    def call(id_: str, arguments: str) -> dict[str, Any]:
        return {"index": 0, "id": id_, "function": {"name": "echo", "arguments": arguments}}

    got = decode(chunk(call("a", '{"m": 1}')), chunk(call("b", '{"m": 2}')),
                 chunk(finish="tool_calls"))
    assert got[:3] == [[ToolCall("a", "echo", {"m": 1}, '{"m": 1}')],
                       [ToolCall("b", "echo", {"m": 2}, '{"m": 2}')], []]
    got = decode(chunk(call("a", '{"m": ')), chunk(fragment(0, "1")),
                 chunk(call("b", '[')), chunk(call("c", '{"m"')), chunk(fragment(0, ": 3}")),
                 chunk(finish="tool_calls"))
    assert got[2] == [ToolCall("a", "echo", None, '{"m": 1')]
    assert got[3] == [ToolCall("b", "echo", None, "[")]
    assert got[4:] == [[ToolCall("c", "echo", {"m": 3}, '{"m": 3}')], [], []]


def test_a_call_without_its_name_yet_waits(caplog: pytest.LogCaptureFixture) -> None:
    """Arguments that close before the call's name has come are complete with the name: at
    the next call or the end."""
    got = decode(chunk({"index": 0, "id": "c", "function": {"arguments": '{"m": 1}'}}),
                 chunk({"index": 0, "function": {"name": "echo"}}),
                 chunk(finish="tool_calls"))
    assert got[:2] == [[], []]
    assert got[2] == [ToolCall("c", "echo", {"m": 1}, '{"m": 1}')]
    assert not caplog.text


def test_usage_is_reported_last_and_only_when_sent(llm: FakeLLM, model: str) -> None:
    llm.script(model, [Turn(text="x" * 40), Turn(text="y" * 40, usage=False)])
    pieces = list(gateway.stream_chat(config(llm, model), MESSAGES))
    usage = pieces[-1]
    assert isinstance(usage, Usage)
    assert usage.completion_tokens == 10 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert not any(isinstance(piece, Usage)
                   for piece in gateway.stream_chat(config(llm, model), MESSAGES))


def test_a_models_requests_share_one_kept_alive_connection(model: str) -> None:
    """A job's turns, retries and errors reach the server over one connection: no request
    after the first pays for a new one (a TCP and, with a real provider, a TLS handshake)."""
    with FakeLLM() as server:
        server.script(model, [
            Turn(text="one"),
            Turn(fail_status=500), Turn(text="two"),
            Turn(text="", tool_calls=[{"id": "c1", "name": "lookup", "arguments": {"k": 1}}]),
            Turn(fail_status=400, error_message="no"),
            Turn(text="three")])
        cfg = config(server, model, max_retries=1)
        assert text_of(list(gateway.stream_chat(cfg, MESSAGES))) == "one"
        assert text_of(list(gateway.stream_chat(cfg, MESSAGES))) == "two"
        # read to its end: a stream closed early (at its call) may leave its connection
        assert any(isinstance(piece, ToolCall) for piece in list(gateway.stream_chat(cfg, MESSAGES)))
        assert failure(gateway.stream_chat(cfg, MESSAGES)).status == 400
        assert text_of(list(gateway.stream_chat(cfg, MESSAGES))) == "three"
        assert len(server.requests(model)) == 6
        assert server.connections == 1


def test_a_connection_the_server_closed_while_idle_is_replaced(model: str) -> None:
    """Closing the fake ends its kept-alive connections: a client's pooled one is dropped and
    the next request, to another server, opens its own."""
    with FakeLLM() as first:
        first.script(model, [Turn(text="a")])
        assert text_of(list(gateway.stream_chat(config(first, model), MESSAGES))) == "a"
    with FakeLLM() as second:
        second.script(model, [Turn(text="b")])
        assert text_of(list(gateway.stream_chat(config(second, model), MESSAGES))) == "b"
        assert second.connections == 1


def test_without_keep_alive_each_request_opens_a_connection(model: str) -> None:
    with FakeLLM(keep_alive=False) as server:
        server.script(model, [Turn(text="a"), Turn(text="b")])
        for text in ("a", "b"):
            assert text_of(list(gateway.stream_chat(config(server, model), MESSAGES))) == text
        assert server.connections == 2


# -- retries and errors ----------------------------------------------------------------------
def test_a_500_is_retried_and_then_succeeds(llm: FakeLLM, model: str) -> None:
    llm.script(model, [Turn(fail_status=500), Turn(text="second time lucky")])
    pieces = list(gateway.stream_chat(config(llm, model), MESSAGES))
    assert text_of(pieces) == "second time lucky"
    assert len(llm.requests(model)) == 2
    assert settled(llm, model) == ["failed", "complete"]


def test_429_honours_retry_after(llm: FakeLLM, model: str,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait before the retry is the `Retry-After` (plus at most 50 ms of jitter)."""
    slept: list[float] = []
    monkeypatch.setattr(transport, "_sleep", slept.append)
    llm.script(model, [Turn(fail_status=429, headers={"Retry-After": "1"},
                            error_message="Rate limit reached"), Turn(text="ok")])
    assert text_of(list(gateway.stream_chat(config(llm, model), MESSAGES))) == "ok"
    assert len(llm.requests(model)) == 2
    (wait,) = slept
    assert 1.0 <= wait <= 1.05


def test_retries_are_bounded_and_the_last_error_is_raised(llm: FakeLLM, model: str) -> None:
    llm.script(model, [Turn(fail_status=503, error_message="overloaded")] * 3)
    error = failure(gateway.stream_chat(config(llm, model, max_retries=2), MESSAGES))
    assert error.retryable and error.status == 503 and error.streamed == 0
    assert "overloaded" in str(error) and "3 attempts" in str(error)
    assert len(llm.requests(model)) == 3


def test_a_400_is_not_retried_and_carries_the_servers_message(llm: FakeLLM, model: str) -> None:
    llm.script(model, [Turn(fail_status=400, error_message="messages[1].content is too long"),
                       Turn(text="never")])
    error = failure(gateway.stream_chat(config(llm, model), MESSAGES))
    assert not error.retryable and error.status == 400
    assert "messages[1].content is too long" in str(error) and "HTTP 400" in str(error)
    assert len(llm.requests(model)) == 1


def test_a_401_says_which_key_to_fix(llm: FakeLLM, model: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    llm.script(model, [Turn(fail_status=401, error_message="Incorrect API key provided")])
    monkeypatch.setenv("CORTEX_TEST_WRONG_KEY", "sk-wrong")
    cfg = ModelConfig(base_url=llm.url, model=model, api_key_env="CORTEX_TEST_WRONG_KEY")
    error = failure(gateway.stream_chat(cfg, MESSAGES))
    assert not error.retryable and error.status == 401
    assert "check the API key in the environment variable CORTEX_TEST_WRONG_KEY" in str(error)


@pytest.mark.parametrize("value", [None, ""], ids=["unset", "empty"])
def test_a_missing_key_fails_at_once_naming_its_variable(
        llm: FakeLLM, model: str, monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    """Not four attempts at an endpoint that will refuse (or cannot be reached): no request."""
    llm.script(model, [Turn(text="never")])
    if value is None:
        monkeypatch.delenv("CORTEX_TEST_UNSET_KEY", raising=False)
    else:
        monkeypatch.setenv("CORTEX_TEST_UNSET_KEY", value)
    cfg = ModelConfig(base_url=llm.url, model=model, api_key_env="CORTEX_TEST_UNSET_KEY")
    error = failure(gateway.open_stream(cfg, MESSAGES))
    assert (error.retryable, error.status, error.attempts) == (False, None, 1)
    assert str(error) == ("the model's API key is missing: environment variable "
                          "CORTEX_TEST_UNSET_KEY (api_key_env) is not set; set it, or set "
                          "api_key_env: null for an endpoint that needs no key")
    assert llm.requests(model) == [] and llm.remaining(model) == 1


def test_a_drop_after_text_is_raised_not_retried(llm: FakeLLM, model: str) -> None:
    llm.script(model, [Turn(text="<thought>" + "a" * 100, fail_after_chars=30),
                       Turn(text="never")])
    seen: list[str] = []
    with pytest.raises(ModelError) as info:
        for piece in gateway.stream_chat(config(llm, model), MESSAGES):
            seen.append(piece.text)
    assert info.value.retryable and info.value.streamed == len("".join(seen)) > 0
    assert len(llm.requests(model)) == 1 and settled(llm, model) == ["dropped"]


def test_a_drop_before_any_text_is_retried(llm: FakeLLM, model: str) -> None:
    llm.script(model, [Turn(text="lost", fail_after_chars=0), Turn(text="found")])
    assert text_of(list(gateway.stream_chat(config(llm, model), MESSAGES))) == "found"
    assert settled(llm, model) == ["dropped", "complete"]


def test_closing_the_generator_closes_the_connection(llm: FakeLLM, model: str) -> None:
    llm.script(model, [Turn(text="z" * 4000, tokens_per_second=40)])  # 25 s if read to the end
    gen = gateway.stream_chat(config(llm, model), MESSAGES)
    assert isinstance(next(gen), TextDelta) and isinstance(next(gen), TextDelta)
    gen.close()
    written = len(llm.stream_log(model)[0])  # text deltas the server had written by then
    # the server's next write found the connection closed: it records the disconnect, having
    # written at most the delta in flight and one more, not the rest of the text's 1000
    assert settled(llm, model) == ["client_disconnected"]
    assert len(llm.stream_log(model)[0]) <= written + 2 < 1000


def test_a_server_that_stalls_before_answering_times_out(llm: FakeLLM, model: str) -> None:
    llm.script(model, [Turn(text="late", delay_s=3)])
    error = failure(gateway.stream_chat(config(llm, model, timeout_s=0.3, max_retries=0),
                                        MESSAGES))
    # the client's read timeout ended it, not the server's answer: the error names the timer,
    # and the server, answering at last, found the client gone
    assert error.retryable and error.status is None and error.streamed == 0
    assert "sent nothing for 0.3 s (timeout_s)" in str(error)
    assert error.attempts == 1 and len(llm.requests(model)) == 1
    assert settled(llm, model, timeout=30) == ["client_disconnected"]


def test_a_stall_mid_stream_times_out_with_the_streamed_count(llm: FakeLLM, model: str) -> None:
    llm.script(model, [Turn(text="abcdefgh" * 4, tokens_per_second=1)])  # 1 s between chunks
    error = failure(gateway.stream_chat(config(llm, model, timeout_s=0.3), MESSAGES))
    assert error.retryable and error.streamed == 4
    assert len(llm.requests(model)) == 1


def test_an_unreachable_endpoint_is_retryable_and_says_so(model: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = ModelConfig(base_url=f"http://127.0.0.1:{port}/v1", model=model, api_key_env=None,
                      max_retries=1)
    error = failure(gateway.stream_chat(cfg, MESSAGES))
    assert error.retryable and "could not be reached" in str(error)


def test_an_unset_base_url_variable_is_a_clear_error(model: str) -> None:
    cfg = ModelConfig(base_url="${CORTEX_TEST_UNSET_URL}/v1", model=model)
    error = failure(gateway.stream_chat(cfg, MESSAGES))
    assert not error.retryable and "CORTEX_TEST_UNSET_URL" in str(error)


def test_sse_parsing_edge_cases() -> None:
    lines = [": keep-alive", "", "event: message",
             'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}', "",
             'data:{"choices": [{"index": 0, "delta": {"content": "b"}}]}', "",
             "data: {\"choices\": [{\"index\": 0,", "data: \"delta\": {\"content\": \"c\"}}]}", "",
             'data: {"choices": [{"index": 1, "delta": {"content": "other choice"}}]}', "",
             'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}', ""]
    pieces = list(decode_lines(gateway.ChatDecoder("u"), iter(lines)))
    assert text_of(pieces) == "abc"
    with pytest.raises(ModelError, match="before the completion finished"):
        list(decode_lines(gateway.ChatDecoder("u"), iter(lines[:4])))
    with pytest.raises(ModelError, match="mid-stream: boom"):
        list(decode_lines(gateway.ChatDecoder("u"), iter(['data: {"error": {"message": "boom"}}', ""])))


def test_a_server_that_ignores_stream_true_still_works(model: str) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/old/chat/completions"):
            return httpx.Response(301, headers={"Location": "https://new.example/v1"})
        return httpx.Response(200, json={
            "object": "chat.completion",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": "whole",
                "tool_calls": [{"id": "c1", "type": "function",
                                "function": {"name": "echo", "arguments": "{}"}}]}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        cfg = ModelConfig(base_url="http://llm.test/v1", model=model, api_key_env=None)
        assert list(gateway.stream_chat(cfg, MESSAGES, client=client)) == [
            TextDelta("whole"), ToolCall("c1", "echo", {}, "{}"), Usage(3, 2, 5)]
        moved = cfg.model_copy(update={"base_url": "http://llm.test/old"})
        error = failure(gateway.stream_chat(moved, MESSAGES, client=client))
    assert not error.retryable and "https://new.example/v1" in str(error)


# -- complete ---------------------------------------------------------------------------------
def test_complete_joins_the_text_and_retries_a_broken_stream(llm: FakeLLM, model: str) -> None:
    llm.script(model, [Turn(text="partial answer", fail_after_chars=5),
                       Turn(text="the whole answer")])
    text, usage = gateway.complete(config(llm, model), MESSAGES)
    assert text == "the whole answer" and usage is not None and usage.completion_tokens == 4
    assert settled(llm, model) == ["dropped", "complete"]


def test_complete_has_one_retry_budget_for_broken_streams_and_failed_requests(
        llm: FakeLLM, model: str) -> None:
    # max_retries 2: three requests in all, whichever way each one failed
    llm.script(model, [Turn(text="partial answer", fail_after_chars=5),
                       Turn(fail_status=500, error_message="down"),
                       Turn(text="partial again", fail_after_chars=5),
                       Turn(text="never asked for")])
    with pytest.raises(ModelError):
        gateway.complete(config(llm, model, max_retries=2), MESSAGES)
    assert len(llm.requests(model)) == 3


def test_a_failure_says_how_many_attempts_were_made_without_retries(
        llm: FakeLLM, model: str) -> None:
    llm.script(model, [Turn(fail_status=503, error_message="overloaded")])
    error = failure(gateway.stream_chat(config(llm, model, max_retries=0), MESSAGES))
    assert "1 attempt made; max_retries is 0" in str(error) and error.attempts == 1


def test_the_fake_server_also_answers_non_streaming_requests(llm: FakeLLM, model: str) -> None:
    llm.script(model, [Turn(text="plain", tool_calls=[{"id": "c1", "name": "echo",
                                                        "arguments": {"message": 1}}])])
    response = httpx.post(f"{llm.url}/chat/completions",
                          json={"model": model, "messages": MESSAGES, "stream": False})
    data = response.json()
    assert data["object"] == "chat.completion"
    message = data["choices"][0]["message"]
    assert message["content"] == "plain"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"message": 1}
    missing = httpx.post(f"{llm.url}/chat/completions", json={"model": model, "messages": []})
    assert missing.status_code == 400 and model in missing.json()["error"]["message"]


# -- native tool calls as protocol text --------------------------------------------------------
def only_action(text: str) -> Any:
    events = [e for e in parse_document(text) if e.type != p.TEXT]
    assert [e.type for e in events] == [p.ACTION_PARSED], events
    return events[0].data["action"]


def test_a_tool_call_becomes_an_async_tool_action() -> None:
    call = ToolCall("call_Ab-3.x", "calculator", {"expression": "1 + 2", "note": "</action> é"})
    text = tool_call_to_protocol(call)
    assert text.startswith('<action type="tool" mode="async" id="call_Ab_3_x">')
    action = only_action(text)
    assert (action.id, action.type.value, action.mode.value) == ("call_Ab_3_x", "tool", "async")
    assert action.name == "calculator"
    assert action.parameters == {"expression": "1 + 2", "note": "</action> é"}


def test_protocol_ids_are_variable_names() -> None:
    assert protocol_id("call_abc123") == "call_abc123"
    assert protocol_id("123-abc") == "call_123_abc"
    assert protocol_id("---") == ""
    action = only_action(tool_call_to_protocol(ToolCall("", "echo", {})))
    assert action.generated_id and action.name == "echo" and action.parameters == {}


def test_invalid_raw_arguments_become_an_invalid_json_protocol_error() -> None:
    call = ToolCall.from_raw("call_1", "echo", '{"message": "hi" "oops": 1}')
    assert call.arguments is None
    events = parse_document(tool_call_to_protocol(call))
    errors = [e.data for e in events if e.type == p.PROTOCOL_ERROR]
    assert [e["kind"] for e in errors] == ["invalid_json"]
    assert errors[0]["line"] == 1 and errors[0]["column"] > 1
    assert errors[0]["action_id"] == "call_1"
    assert not [e for e in events if e.type == p.ACTION_PARSED]


@pytest.mark.parametrize("raw", ['[1, 2]', '"text"', '{"a": 1}, "name": "python"'])
def test_non_object_or_smuggling_arguments_are_rejected(raw: str) -> None:
    call = ToolCall.from_raw("call_1", "echo", raw)
    assert call.arguments is None
    events = parse_document(tool_call_to_protocol(call))
    assert [e.data["kind"] for e in events if e.type == p.PROTOCOL_ERROR] == ["invalid_json"]
    assert not [e for e in events if e.type == p.ACTION_PARSED]


def test_repairable_raw_arguments_are_repaired_like_textual_actions() -> None:
    call = ToolCall.from_raw("call_1", "echo", '{"message": "hi",}')
    assert call.arguments is None
    events = parse_document(tool_call_to_protocol(call))
    assert [e.data["kind"] for e in events if e.type == p.WARNING] == ["repaired_json"]
    (parsed,) = [e for e in events if e.type == p.ACTION_PARSED]
    assert parsed.data["action"].parameters == {"message": "hi"}


def test_a_continued_answer_asks_vllm_to_continue_its_final_message() -> None:
    """`continuation: continue_final_message` (vLLM, SGLang) sends its two fields when the last
    message is the partial answer; `prefill` (llama.cpp, Anthropic) needs none; neither when
    the last message is the user's."""
    from cortex_worker.llm import anthropic
    from cortex_worker.llm.gateway import _request_body

    partial = [{"role": "user", "content": "Go."},
               {"role": "assistant", "content": "<thought>Thinking with"}]
    vllm = ModelConfig(model="m", continuation="continue_final_message")
    body = _request_body(vllm, partial, None)
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert "continue_final_message" not in _request_body(vllm, partial[:1], None)
    assert "continue_final_message" not in _request_body(
        ModelConfig(model="m", continuation="prefill"), partial, None)
    claude = ModelConfig(provider="anthropic")
    assert claude.continuation == "prefill"  # Anthropic continues a last assistant message
    request = anthropic.to_messages_request(partial)
    assert request["messages"][-1] == {"role": "assistant", "content": [
        {"type": "text", "text": "<thought>Thinking with"}]}


def test_tool_choice_is_sent_in_each_providers_words_with_tools_only() -> None:
    """OpenAI: `required`/`none` as they are, `auto` left out (the default; vLLM refuses an
    explicit one without --enable-auto-tool-choice). Anthropic: `any`/`none`. Without tools,
    nothing: there is nothing to choose."""
    from cortex_worker.llm import anthropic
    from cortex_worker.llm.gateway import _request_body

    messages = [{"role": "user", "content": "Go."}]
    tools = [{"type": "function", "function": {"name": "echo", "description": "Echo.",
                                               "parameters": {"type": "object"}}}]
    for choice, sent in (("required", "required"), ("none", "none"), ("auto", None)):
        config = ModelConfig(model="m", tool_choice=choice)
        assert _request_body(config, messages, tools).get("tool_choice") == sent
        assert "tool_choice" not in _request_body(config, messages, None)
    for choice, kind in (("required", "any"), ("none", "none")):
        claude = ModelConfig(provider="anthropic", tool_choice=choice)
        assert anthropic._request_body(claude, messages, tools)["tool_choice"] == {"type": kind}
    assert "tool_choice" not in anthropic._request_body(ModelConfig(provider="anthropic"),
                                                        messages, tools)


def test_a_tool_named_by_tool_choice_is_forced_in_each_providers_words() -> None:
    """A tool's name (the OpenAI Agents SDK's `tool_choice="get_weather"`): OpenAI's
    `{"type": "function", ...}`, Anthropic's `{"type": "tool", ...}`, with the name it has as
    a native function (an MCP tool's dot becomes `__`)."""
    from cortex_worker.llm import anthropic
    from cortex_worker.llm.gateway import _request_body

    messages = [{"role": "user", "content": "Go."}]
    tools = [{"type": "function", "function": {"name": "time__now", "parameters": {}}}]
    config = ModelConfig(model="m", tool_choice="time.now")
    assert config.forced_tool == "time.now"
    assert _request_body(config, messages, tools)["tool_choice"] == {
        "type": "function", "function": {"name": "time__now"}}
    claude = ModelConfig(provider="anthropic", tool_choice="time.now")
    assert anthropic._request_body(claude, messages, tools)["tool_choice"] == {
        "type": "tool", "name": "time__now"}
    assert ModelConfig(model="m", tool_choice="required").forced_tool is None
    with pytest.raises(ValueError):
        ModelConfig(model="m", tool_choice="")


def test_a_seed_is_sent_with_every_request_when_set() -> None:
    """`seed` goes into the OpenAI-compatible body (streamed or not) as it is, and only when
    set; Anthropic's Messages API has no seed, so a model block may not give it one."""
    from cortex_worker.llm.gateway import _request_body

    messages = [{"role": "user", "content": "Go."}]
    seeded = ModelConfig(model="m", temperature=0.7, seed=1125)
    assert _request_body(seeded, messages, None)["seed"] == 1125
    assert _request_body(seeded, messages, None, stream=False)["seed"] == 1125
    assert "seed" not in _request_body(ModelConfig(model="m"), messages, None)
    assert ModelConfig(model="m", seed=0).wire() == {"model": "m", "seed": 0}
    with pytest.raises(ValueError, match="takes no seed"):
        ModelConfig(provider="anthropic", seed=1)
    for wrong in (-1, 2**31):
        with pytest.raises(ValueError):
            ModelConfig(model="m", seed=wrong)


def test_a_model_on_the_wire_is_read_by_the_version_before_and_after() -> None:
    """`wire()` leaves defaults out (a worker of the version before reads it unless a new
    field is used); `from_wire` ignores a field a newer version wrote (a manifest may not)."""
    config = ModelConfig(model="m", base_url="http://127.0.0.1:1/v1", api_key_env=None,
                         tool_choice="required")
    wire = config.wire()
    assert wire == {"base_url": "http://127.0.0.1:1/v1", "model": "m", "api_key_env": None,
                    "tool_choice": "required"}
    assert ModelConfig.from_wire(wire) == config
    assert ModelConfig.from_wire({**wire, "from_a_newer_version": 1}) == config
    with pytest.raises(ValueError, match="from_a_newer_version"):
        ModelConfig.model_validate({**wire, "from_a_newer_version": 1})


def test_an_output_schema_is_sent_in_each_providers_words() -> None:
    """OpenAI: `response_format` json_schema; Anthropic: `output_format` (structured outputs,
    under its beta header)."""
    from cortex_worker.llm import anthropic
    from cortex_worker.llm.gateway import _request_body

    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}}
    messages = [{"role": "user", "content": "Go."}]
    body = _request_body(ModelConfig(model="m"), messages, None, output_schema=schema)
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": schema}}
    assert "response_format" not in _request_body(ModelConfig(model="m"), messages, None)
    claude = anthropic._request_body(ModelConfig(provider="anthropic"), messages, None, schema)
    assert claude["output_format"] == {"type": "json_schema", "schema": schema}
