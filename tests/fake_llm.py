"""A real OpenAI-compatible chat-completions server for tests, on a free loopback port.

    with FakeLLM() as llm:
        llm.script("m", [Turn(text="<thought>hi</thought>"), Turn(fail_status=500)])
        config = ModelConfig(base_url=llm.url, model="m", api_key_env=None)
        ...
        llm.requests("m")      # the JSON bodies received, in order, each with `received_at`
        llm.stream_log("m")    # per request: [(monotonic time, text chars sent so far), ...]
        llm.token_times("m")   # per request: when each token (text or tool-call piece) was sent
        llm.outcomes("m")      # per request: "complete", "client_disconnected", "dropped", ...

    # a real provider's rate limits, for every model (each its own) or one model:
    with FakeLLM(rate_limit=RateLimit(requests_per_window=10, window_s=1.0)) as llm:
        llm.limit("m", RateLimit(max_in_flight=4, tokens_per_window=20_000))
        llm.script_default("m", lambda body: Turn(text="<thought>ok</thought>"))
        ...
        llm.refused("m")             # how many requests the limiter answered with 429
        llm.admitted("m")            # per admitted request: (monotonic admitted, finished or None)
        llm.in_flight("m")           # admitted requests whose answer is not finished yet
        llm.max_in_flight_seen("m")  # the peak of in_flight

Each request for a model pops that model's next `Turn`; a request with none left is answered
by the model's default (`script_default(model, make)`: `make(request body)` returns the
`Turn`), or without one gets a 400 naming the model. Streaming requests (`"stream": true`) get
`chat.completion.chunk` server-sent events written one chunk at a time (HTTP/1.1 chunked
encoding), paced at `tokens_per_second` with one chunk = one token of `chunk_chars`
characters; tool calls are sent as OpenAI-style fragments (id and name first, then the
arguments in pieces). Non-streaming requests get a plain `chat.completion`.

Rate limits (`RateLimit`) work as a provider's: a sliding window of `window_s` seconds admits a
request while fewer than `requests_per_window` were admitted in it and their estimated tokens
plus its own stay within `tokens_per_window` (a request's tokens: its messages' JSON length / 4,
rounded up, as `usage.prompt_tokens` reports them, plus its `max_tokens` or
`max_completion_tokens`); `max_in_flight` admits a request while fewer admitted ones are still
being answered (a stream until its last byte). A refused request pops no turn: it gets a 429
with OpenAI's error body (`{"error": {"message", "type": "requests" | "tokens", "param",
"code": "rate_limit_exceeded"}}`), `retry-after` (whole seconds, `RateLimit.retry_after_s`
rounded up; none when that is None) and the rate-limit headers; it is recorded among
`requests()` with the outcome `rate_limited`. Every answer to an admitted request carries the
headers too (a turn's own `headers` win): `x-ratelimit-limit-requests`,
`x-ratelimit-remaining-requests` (after this request), `x-ratelimit-reset-requests` (the time
until the window frees a request, written as OpenAI writes it: `0s`, `250ms`, `1.5s`, `6m0s`),
and the same `-tokens` triple when tokens are limited. Each model has its own window; the
window counts the requests admitted while a limit applies. Admissions and in-flight counts are
kept with or without a limit (`admitted`, `max_in_flight_seen`), so a test can check a client's
own limiter against a server that refuses nothing. With `RateLimit(counts=False)` no answer
carries the rate-limit headers, and a 429 says only `retry-after` (as many OpenAI-compatible
servers do).

Connections are kept alive between requests, as real providers keep them (`keep_alive=False`
closes each after its answer); closing the server closes them too, so a client's pooled
connection never reaches a stopped server. The server runs in a background thread (`http.server.ThreadingHTTPServer`, no extra
dependencies); workers reach it over HTTP, so it serves other processes too. Times are
`time.monotonic()`, comparable within this machine.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import socket
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

__all__ = ["HOLD_TIMEOUT_S", "FakeLLM", "RateLimit", "Turn"]

#: The longest a `Turn.holds` entry holds its stream when its event is never set.
HOLD_TIMEOUT_S = 60.0


@dataclass
class Turn:
    """One scripted answer.

    `text`: the content streamed; `tokens_per_second`/`chunk_chars`: pacing (each chunk is one
    token of `chunk_chars` characters); `tool_calls`: `{"id", "name", "arguments"}` with
    arguments a dict or raw text (sent verbatim, may be invalid JSON); `fail_status`: answer
    with this HTTP status and `{"error": {"message": ...}}` instead; `fail_after_chars`: stream
    that many characters of text, then drop the connection without ending the body;
    `usage`: send a usage chunk when the request asks for it; `headers`: extra response headers
    (e.g. `{"Retry-After": "1"}`); `delay_s`: wait this long before answering at all (to
    trigger client timeouts); `error_message`: the message of a `fail_status` answer;
    `end_token`: the end of the message (its `finish_reason` chunk) comes a token after the
    last one, as an engine streams it once the model has written its end-of-turn token
    (otherwise it follows the last chunk at once); `holds`: token number (from 0, as in
    `token_times`) -> an event the test sets: once that token is written, nothing more is
    until it is set (or `HOLD_TIMEOUT_S` passed, so a runtime that never gets there fails the
    test's assertions instead of hanging it): a test observes what the runtime did mid-stream
    by the order of events, not by the clock.
    """

    text: str = ""
    tokens_per_second: float = 200
    chunk_chars: int = 4
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    fail_status: int | None = None
    fail_after_chars: int | None = None
    usage: bool = True
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    error_message: str | None = None
    end_token: bool = False
    holds: dict[int, threading.Event] = field(default_factory=dict)


@dataclass(frozen=True)
class RateLimit:
    """A provider's limits on one model (see the module's docstring); None: no such limit.

    `requests_per_window`: requests admitted per sliding window of `window_s` seconds;
    `max_in_flight`: admitted requests still being answered; `tokens_per_window`: estimated
    tokens (prompt + `max_tokens`) admitted per window; `retry_after_s`: the `retry-after` of a
    429, rounded up to whole seconds (no header when None).
    """

    requests_per_window: int | None = None
    window_s: float = 1.0
    max_in_flight: int | None = None
    tokens_per_window: int | None = None
    retry_after_s: float | None = 1.0
    counts: bool = True
    """Send the provider's rate-limit headers (`x-ratelimit-*`, `anthropic-ratelimit-*`);
    False: a 429's `retry-after` is all it says, as many OpenAI-compatible servers do."""

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"RateLimit.window_s must be positive, not {self.window_s}")
        for name in ("requests_per_window", "max_in_flight", "tokens_per_window"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"RateLimit.{name} must not be negative, not {value}")


@dataclass
class _Slot:
    """One admitted request: when admitted, when its answer finished."""

    at: float
    finished: float | None = None


@dataclass
class _Load:
    """One model's limiter state and bookkeeping."""

    window: deque[tuple[float, int]] = field(default_factory=deque)  # (admitted at, tokens)
    window_tokens: int = 0
    admitted: list[_Slot] = field(default_factory=list)
    in_flight: int = 0
    peak: int = 0
    refused: int = 0


@dataclass(frozen=True)
class _Admission:
    """The limiter's answer to one request, and the window as it left it."""

    limit: RateLimit | None
    now: float
    slot: int | None  # the request's index in `admitted`; None: refused
    reason: str | None  # why refused: "requests", "tokens" or "in_flight"
    requests: int  # admitted in the window (this one included when admitted)
    tokens: int  # their tokens
    cost: int  # this request's tokens (0 unless tokens are limited)
    oldest: float | None  # when the window's oldest and newest requests were admitted
    newest: float | None
    in_flight: int

    def frees_at(self) -> float:
        """When the window next frees a request (and its tokens): now if it is empty."""
        assert self.limit is not None
        return self.now if self.oldest is None else self.oldest + self.limit.window_s

    def empties_at(self) -> float:
        """When the window is wholly free again."""
        assert self.limit is not None
        return self.now if self.newest is None else self.newest + self.limit.window_s


def _duration(seconds: float) -> str:
    """A duration as OpenAI's rate-limit headers write it (Go's style, in whole milliseconds
    rounded up): `0s`, `12ms`, `1s`, `1.5s`, `6m0s`, `1h2m3.5s`."""
    ms = max(0, math.ceil(round(seconds * 1000, 6)))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, ms = divmod(ms, 60_000)
    hours, minutes = divmod(minutes, 60)
    secs = f"{ms / 1000:.3f}".rstrip("0").rstrip(".")
    if not hours and not minutes:
        return f"{secs}s"
    return (f"{hours}h" if hours else "") + f"{minutes}m{secs}s"


def _rfc3339(at: float) -> str:
    """A `time.monotonic()` instant as an RFC 3339 UTC timestamp, milliseconds rounded up."""
    wall = time.time() + (at - time.monotonic())
    stamp = datetime.datetime.fromtimestamp(math.ceil(wall * 1000) / 1000, datetime.UTC)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class _Dropped(Exception):
    """The scripted connection drop."""


class _Server(ThreadingHTTPServer):
    """Serves each connection in a thread and knows the open ones, to close them at the end.

    Accepted sockets send without Nagle's delay (TCP_NODELAY): an answer's head and body go
    out in separate small writes, and on a kept-alive connection the second waited for the
    client's delayed ACK (~40 ms a request). The listen backlog is a provider's, not
    socketserver's 5, so a burst of clients (two workers' threads at once) is not dropped."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        self.accepted = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        with contextlib.suppress(OSError):
            request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._open_lock:
            self._open.add(request)
            self.accepted += 1
        super().process_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away is not the server's error: no traceback for it (e.g. a
        reset while the next request was awaited: the client closed the connection with the
        tail of an answer unread, as an agent does that stops reading at a sync action)."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """End every open connection: a handler waiting for its next request sees the end."""
        with self._open_lock:
            connections = list(self._open)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


class FakeLLM:
    """The server; a context manager. `url` is the base URL, ending in `/v1`."""

    _handler: type[BaseHTTPRequestHandler]  # set below the handler's class
    _name = "fake-llm"

    def __init__(self, host: str = "127.0.0.1", *, keep_alive: bool = True,
                 rate_limit: RateLimit | None = None) -> None:
        self._host = host
        self.keep_alive = keep_alive
        self._lock = threading.Lock()
        self._rate_limit = rate_limit
        self._limits: dict[str, RateLimit | None] = {}
        self._loads: dict[str, _Load] = {}
        self._defaults: dict[str, Callable[[dict[str, Any]], Any]] = {}
        self._closing = threading.Event()
        self._turns: dict[str, list[Turn]] = {}
        self._requests: dict[str, list[dict[str, Any]]] = {}
        self._headers: dict[str, list[dict[str, str]]] = {}
        self._logs: dict[str, list[list[tuple[float, int]]]] = {}
        self._ticks: dict[str, list[list[float]]] = {}
        self._outcomes: dict[str, list[str]] = {}
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> Self:
        """Bind a free port and serve in a daemon thread."""
        handler = type("Handler", (self._handler,), {"fake": self})
        server = _Server((self._host, 0), handler)
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name=self._name,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and end every connection; handlers still streaming stop at their
        next chunk."""
        self._closing.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server.close_connections()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("FakeLLM is not started; use it as a context manager")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    @property
    def connections(self) -> int:
        """How many connections the server has accepted so far."""
        return self._server.accepted if self._server is not None else 0

    # -- scripting and inspection -------------------------------------------------------------
    def script(self, model: str, turns: list[Turn]) -> None:
        """Append turns for `model`; each request pops the next one."""
        with self._lock:
            self._turns.setdefault(model, []).extend(turns)

    def script_default(self, model: str, make: Callable[[dict[str, Any]], Turn] | None) -> None:
        """Answer a request for `model` that finds no scripted turn left with `make(its JSON
        body)` (called in the serving thread, without the server's lock held) instead of a 400;
        None: the 400 again."""
        with self._lock:
            if make is None:
                self._defaults.pop(model, None)
            else:
                self._defaults[model] = make

    def limit(self, model: str, rate_limit: RateLimit | None) -> None:
        """Limit `model` by `rate_limit` instead of the server's `rate_limit` (None: no limit
        for it). Its window keeps the requests admitted so far."""
        with self._lock:
            self._limits[model] = rate_limit

    def refused(self, model: str) -> int:
        """How many requests for `model` the rate limiter answered with a 429."""
        with self._lock:
            load = self._loads.get(model)
            return load.refused if load else 0

    def admitted(self, model: str) -> list[tuple[float, float | None]]:
        """Per request for `model` past the rate limiter (with or without a limit), in order:
        (when admitted, when its answer finished or None while it is being answered)."""
        with self._lock:
            load = self._loads.get(model)
            return [(slot.at, slot.finished) for slot in load.admitted] if load else []

    def in_flight(self, model: str) -> int:
        """How many admitted requests for `model` are being answered now."""
        with self._lock:
            load = self._loads.get(model)
            return load.in_flight if load else 0

    def max_in_flight_seen(self, model: str) -> int:
        """The most requests for `model` being answered at once so far."""
        with self._lock:
            load = self._loads.get(model)
            return load.peak if load else 0

    def remaining(self, model: str) -> int:
        """How many scripted turns of `model` are not yet used."""
        with self._lock:
            return len(self._turns.get(model, []))

    def requests(self, model: str) -> list[dict[str, Any]]:
        """The JSON bodies received for `model`, in order, each with a `received_at` time."""
        with self._lock:
            return [dict(r) for r in self._requests.get(model, [])]

    def request_headers(self, model: str) -> list[dict[str, str]]:
        """The headers of each request for `model` (lower-case names)."""
        with self._lock:
            return [dict(h) for h in self._headers.get(model, [])]

    def stream_log(self, model: str) -> list[list[tuple[float, int]]]:
        """Per request: (time, text characters sent so far) after each text chunk was written."""
        with self._lock:
            return [list(log) for log in self._logs.get(model, [])]

    def token_times(self, model: str) -> list[list[float]]:
        """Per streamed request: when each token was written, text chunks and tool-call
        fragments alike (a call's first fragment, with its id and name, is one token)."""
        with self._lock:
            return [list(ticks) for ticks in self._ticks.get(model, [])]

    def outcomes(self, model: str) -> list[str]:
        """Per request: `complete`, `failed` (fail_status), `dropped` (fail_after_chars),
        `client_disconnected`, `no_turn`, `rate_limited` (refused with a 429), or `streaming`
        while still in progress."""
        with self._lock:
            return list(self._outcomes.get(model, []))

    # -- used by the handler --------------------------------------------------------------------
    def _new_request(self, model: str, body: dict[str, Any], headers: dict[str, str],
                     outcome: str) -> int:
        """Start the bookkeeping of a request (the caller holds the lock); its index."""
        requests = self._requests.setdefault(model, [])
        requests.append({**body, "received_at": time.monotonic()})
        self._headers.setdefault(model, []).append(headers)
        self._logs.setdefault(model, []).append([])
        self._ticks.setdefault(model, []).append([])
        self._outcomes.setdefault(model, []).append(outcome)
        return len(requests) - 1

    def _record(self, model: str, body: dict[str, Any], headers: dict[str, str]
                ) -> tuple[int, Turn | None]:
        with self._lock:
            index = self._new_request(model, body, headers, "streaming")
            turns = self._turns.get(model)
            turn = turns.pop(0) if turns else None
        return index, continued(turn if turn is not None else self._default_turn(model, body),
                                body)

    def _default_turn(self, model: str, body: dict[str, Any]) -> Any:
        with self._lock:
            make = self._defaults.get(model)
        return None if make is None else make(body)

    def _admit(self, model: str, body: dict[str, Any], headers: dict[str, str],
               cost: Callable[[], int]) -> _Admission:
        """Admit a request to `model` or refuse it (recording it as `rate_limited`), as the
        model's limit says; `cost()`: its tokens, asked for only when tokens are limited."""
        with self._lock:
            now = time.monotonic()
            limit = self._limits.get(model, self._rate_limit)
            load = self._loads.setdefault(model, _Load())
            tokens = 0
            reason = None
            if limit is not None:
                while load.window and load.window[0][0] <= now - limit.window_s:
                    load.window_tokens -= load.window.popleft()[1]
                if limit.tokens_per_window is not None:
                    tokens = cost()
                if (limit.requests_per_window is not None
                        and len(load.window) >= limit.requests_per_window):
                    reason = "requests"
                elif (limit.tokens_per_window is not None
                        and load.window_tokens + tokens > limit.tokens_per_window):
                    reason = "tokens"
                elif limit.max_in_flight is not None and load.in_flight >= limit.max_in_flight:
                    reason = "in_flight"
            slot = None
            if reason is None:
                if limit is not None:
                    load.window.append((now, tokens))
                    load.window_tokens += tokens
                load.admitted.append(_Slot(now))
                slot = len(load.admitted) - 1
                load.in_flight += 1
                load.peak = max(load.peak, load.in_flight)
            else:
                load.refused += 1
                self._new_request(model, body, headers, "rate_limited")
            return _Admission(
                limit=limit, now=now, slot=slot, reason=reason, requests=len(load.window),
                tokens=load.window_tokens, cost=tokens,
                oldest=load.window[0][0] if load.window else None,
                newest=load.window[-1][0] if load.window else None, in_flight=load.in_flight)

    def _finish(self, model: str, slot: int) -> None:
        """The answer to the admitted request `slot` is finished (or abandoned)."""
        with self._lock:
            load = self._loads[model]
            load.admitted[slot].finished = time.monotonic()
            load.in_flight -= 1

    def _log(self, model: str, index: int, chars: int) -> None:
        with self._lock:
            self._logs[model][index].append((time.monotonic(), chars))

    def _tick(self, model: str, index: int) -> None:
        with self._lock:
            self._ticks[model][index].append(time.monotonic())

    def _outcome(self, model: str, index: int, outcome: str) -> None:
        with self._lock:
            self._outcomes[model][index] = outcome

    def _wait(self, seconds: float) -> None:
        if seconds > 0 and self._closing.wait(seconds):
            raise ConnectionAbortedError("FakeLLM closed")

    def _hold(self, release: threading.Event) -> None:
        """Until the test sets `release`, `HOLD_TIMEOUT_S` passed, or the server closes."""
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        while not release.wait(0.05) and time.monotonic() < deadline:
            if self._closing.is_set():
                raise ConnectionAbortedError("FakeLLM closed")


def continued(turn: Any, body: dict[str, Any]) -> Any:
    """A request whose last message is the assistant's asks to continue it (llama.cpp's and
    Anthropic's prefill, vLLM's `continue_final_message`): the scripted answer goes on after
    that text, if it starts with it (a turn taken over mid-answer asks for the same turn)."""
    messages = body.get("messages") or []
    if turn is None or not messages or messages[-1].get("role") != "assistant":
        return turn
    content = messages[-1].get("content") or ""
    prefix = content if isinstance(content, str) else "".join(
        block.get("text", "") for block in content if isinstance(block, dict))
    if prefix and turn.text.startswith(prefix):
        return replace(turn, text=turn.text[len(prefix):])
    return turn


def _tokens(chars: int) -> int:
    return math.ceil(chars / 4)


def _arguments_text(call: dict[str, Any]) -> str:
    arguments = call.get("arguments", {})
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeLLM  # set on the subclass made by FakeLLM.start
    _rate_headers: dict[str, str]  # the rate-limit headers of the answer to this request
    _admitted: tuple[str, int] | None  # (model, slot) of this request while it is in flight
    _ending: tuple[str, int, str] | None  # (model, index, outcome) to record at the last write

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def handle_one_request(self) -> None:
        self._rate_headers = {}
        self._admitted = None
        self._ending = None
        super().handle_one_request()

    # -- plumbing ---------------------------------------------------------------------------
    def _end_headers(self, headers: dict[str, str]) -> None:
        """Send `headers` (after the rate-limit headers, which they override) and end the head;
        without keep-alive, say the connection closes."""
        if not self.fake.keep_alive:
            self.send_header("Connection", "close")
            self.close_connection = True
        for name, value in {**self._rate_headers, **headers}.items():
            self.send_header(name, value)
        self.end_headers()

    def _release(self) -> None:
        """Just before an answer's last write: its outcome (`_ending`) is recorded and it
        leaves the in-flight count, so a client that has read the whole answer never finds
        the server's bookkeeping behind it (a next request sent the moment an answer ended
        was refused for a slot not yet given back; `outcomes()` read then still said
        `streaming`). A last write that fails records `client_disconnected` after it."""
        if self._ending is not None:
            model, index, outcome = self._ending
            self._ending = None
            self.fake._outcome(model, index, outcome)
        self._finished()

    def _finished(self) -> None:
        """This request leaves the in-flight count (once): at its last write, or when its
        handling ends in any way."""
        if self._admitted is not None:
            model, slot = self._admitted
            self._admitted = None
            self.fake._finish(model, slot)

    def _send_json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self._end_headers(headers or {})
        self._release()
        self.wfile.write(data)

    def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        self._send_json(status, {"error": {"message": message, "type": "fake_llm_error",
                                           "code": status}}, headers)

    def _chunk(self, data: bytes, *, last: bool = False) -> None:
        """Write one chunk; `last`: with the body's end in the same write (one segment), so a
        client reading on to the end to keep the connection never waits on this thread."""
        if last:
            self._release()
        self.wfile.write(b"%X\r\n%s\r\n%s" % (len(data), data, b"0\r\n\r\n" if last else b""))

    def _event(self, payload: Any) -> None:
        self._chunk(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def _drop(self) -> None:
        """End the connection without finishing the response body."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)
        raise _Dropped

    # -- routes -------------------------------------------------------------------------------
    def do_GET(self) -> None:
        if self.path.rstrip("/").endswith("/models"):
            with self.fake._lock:
                models = sorted(set(self.fake._turns) | set(self.fake._defaults))
            self._send_json(200, {"object": "list", "data": [
                {"id": m, "object": "model", "owned_by": "fake-llm"} for m in models]})
        else:
            self._error(404, f"FakeLLM serves POST /v1/chat/completions, not GET {self.path}")

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)  # all of it, so the connection can carry the next request
        if not self.path.rstrip("/").endswith("/chat/completions"):
            self._error(404, f"FakeLLM serves POST /v1/chat/completions, not {self.path}")
            return
        try:
            body = json.loads(raw)
            model = str(body["model"])
        except (ValueError, KeyError, TypeError):
            self._error(400, "FakeLLM: the request body must be JSON with a 'model'")
            return
        headers = {k.lower(): v for k, v in self.headers.items()}
        self._admit_and_answer(model, body, headers)

    def _admit_and_answer(self, model: str, body: dict[str, Any],
                          headers: dict[str, str]) -> None:
        """Answer the request if the model's rate limit admits it (a 429 otherwise), with the
        limit's headers; its slot is given back as its answer ends. Both fakes' handlers."""
        admission = self.fake._admit(model, body, headers, lambda: self._token_cost(body))
        if admission.slot is None:
            self._rate_limited(model, admission)
            return
        self._rate_headers = self._limit_headers(admission)
        self._admitted = (model, admission.slot)
        try:
            self._answer(model, body, headers)
        finally:
            self._finished()

    def _answer(self, model: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        fake = self.fake
        index, turn = fake._record(model, body, headers)
        if turn is None:
            fake._outcome(model, index, "no_turn")
            self._error(400, f"FakeLLM has no scripted turn left for model {model!r} (this is "
                             f"request {index + 1}); script more with FakeLLM.script()")
            return
        try:
            fake._wait(turn.delay_s)
            if turn.fail_status is not None:
                fake._outcome(model, index, "failed")
                self._error(turn.fail_status, turn.error_message
                            or f"FakeLLM scripted failure {turn.fail_status}", turn.headers)
            elif body.get("stream"):
                self._ending = (model, index, "complete")
                self._stream(model, index, body, turn)
                fake._outcome(model, index, "complete")
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
        """The tokens a request counts against `tokens_per_window`: its prompt as `usage`
        reports it, plus the most it asks to generate."""
        prompt = _tokens(len(json.dumps(body.get("messages", []))))
        most = body.get("max_completion_tokens") or body.get("max_tokens")
        return prompt + (most if isinstance(most, int) else 0)

    def _limit_headers(self, a: _Admission) -> dict[str, str]:
        """OpenAI's rate-limit headers for the window `a` left."""
        limit = a.limit
        if limit is None or not limit.counts:
            return {}
        reset = _duration(a.frees_at() - a.now)
        headers: dict[str, str] = {}
        if limit.requests_per_window is not None:
            headers["x-ratelimit-limit-requests"] = str(limit.requests_per_window)
            headers["x-ratelimit-remaining-requests"] = str(
                max(0, limit.requests_per_window - a.requests))
            headers["x-ratelimit-reset-requests"] = reset
        if limit.tokens_per_window is not None:
            headers["x-ratelimit-limit-tokens"] = str(limit.tokens_per_window)
            headers["x-ratelimit-remaining-tokens"] = str(
                max(0, limit.tokens_per_window - a.tokens))
            headers["x-ratelimit-reset-tokens"] = reset
        return headers

    def _refusal_headers(self, a: _Admission) -> dict[str, str]:
        headers = self._limit_headers(a)
        assert a.limit is not None
        if a.limit.retry_after_s is not None:
            headers["retry-after"] = str(max(0, math.ceil(a.limit.retry_after_s)))
        return headers

    @staticmethod
    def _limit_message(model: str, a: _Admission) -> str:
        limit = a.limit
        assert limit is not None
        if a.reason == "in_flight":
            return (f"Too many concurrent requests for {model}: Limit {limit.max_in_flight}, "
                    f"In flight {a.in_flight}. Please try again once one has finished.")
        per = _duration(limit.window_s)
        again = _duration(a.frees_at() - a.now)
        if a.reason == "tokens":
            return (f"Rate limit reached for {model} on tokens per {per}: Limit "
                    f"{limit.tokens_per_window}, Used {a.tokens}, Requested {a.cost}. "
                    f"Please try again in {again}.")
        return (f"Rate limit reached for {model} on requests per {per}: Limit "
                f"{limit.requests_per_window}, Used {a.requests}, Requested 1. "
                f"Please try again in {again}.")

    def _rate_limited(self, model: str, a: _Admission) -> None:
        """Refuse a request as OpenAI does."""
        self._send_json(429, {"error": {
            "message": self._limit_message(model, a),
            "type": "tokens" if a.reason == "tokens" else "requests", "param": None,
            "code": "rate_limit_exceeded"}}, self._refusal_headers(a))

    # -- answers ------------------------------------------------------------------------------
    def _usage(self, body: dict[str, Any], turn: Turn) -> dict[str, int]:
        prompt = _tokens(len(json.dumps(body.get("messages", []))))
        completion = _tokens(len(turn.text) + sum(len(_arguments_text(c)) for c in turn.tool_calls))
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def _whole(self, model: str, index: int, body: dict[str, Any], turn: Turn) -> None:
        message: dict[str, Any] = {"role": "assistant", "content": turn.text or None}
        if turn.tool_calls:
            message["tool_calls"] = [
                {"id": c.get("id") or f"call_{i}", "type": "function",
                 "function": {"name": c["name"], "arguments": _arguments_text(c)}}
                for i, c in enumerate(turn.tool_calls)]
        payload = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion",
            "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if turn.tool_calls else "stop"}],
            "usage": self._usage(body, turn),
        }
        if turn.fail_after_chars is not None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(json.dumps(payload))))
            self.end_headers()
            self.wfile.write(json.dumps(payload).encode()[:turn.fail_after_chars])
            self._drop()
        self._send_json(200, payload, turn.headers)
        self.fake._log(model, index, len(turn.text))

    def _stream(self, model: str, index: int, body: dict[str, Any], turn: Turn) -> None:
        fake = self.fake
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self._end_headers(turn.headers)
        base = {"id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": model}

        def delta(content: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {**base, "choices": [{"index": 0, "delta": content, "finish_reason": finish}]}

        interval = 1.0 / turn.tokens_per_second
        start = time.monotonic()
        tick = 0

        def pace() -> None:
            nonlocal tick
            fake._wait(start + tick * interval - time.monotonic())
            tick += 1
            fake._tick(model, index)

        def written() -> None:
            """The token `pace` began is written: hold here if the script says so."""
            if tick - 1 in turn.holds:
                fake._hold(turn.holds[tick - 1])

        size = max(1, turn.chunk_chars)
        limit = turn.fail_after_chars
        self._event(delta({"role": "assistant", "content": ""}))
        if limit == 0:
            self._drop()
        sent = 0
        for offset in range(0, len(turn.text), size):
            piece = turn.text[offset:offset + size]
            if limit is not None:
                piece = piece[:limit - sent]
            pace()
            self._event(delta({"content": piece}))
            sent += len(piece)
            fake._log(model, index, sent)
            if limit is not None and sent >= limit:
                self._drop()
            written()
        for number, call in enumerate(turn.tool_calls):
            pace()
            self._event(delta({"tool_calls": [{
                "index": number, "id": call.get("id") or f"call_{number}", "type": "function",
                "function": {"name": call["name"], "arguments": ""}}]}))
            written()
            arguments = _arguments_text(call)
            for offset in range(0, len(arguments), size):
                pace()
                self._event(delta({"tool_calls": [{
                    "index": number, "function": {"arguments": arguments[offset:offset + size]}}]}))
                written()
        if limit is not None:  # fewer characters than the limit: drop before finishing
            self._drop()
        if turn.end_token:
            pace()
        self._event(delta({}, "tool_calls" if turn.tool_calls else "stop"))
        wants_usage = (body.get("stream_options") or {}).get("include_usage")
        if turn.usage and wants_usage:
            self._event({**base, "choices": [], "usage": self._usage(body, turn)})
        self._chunk(b"data: [DONE]\n\n", last=True)


FakeLLM._handler = _Handler
