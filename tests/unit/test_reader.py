"""The process's model stream reader (cortex_worker/llm/reader.py): its HTTP framing and line
splitting on their own, and whole streams through `gateway.stream_chat` against raw HTTP/1.1
servers on loopback that write their answers in awkward pieces, stall, cut the body short and
keep connections alive, as real model servers do."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import trustme

from cortex_worker.llm import gateway, reader, transport
from cortex_worker.llm.config import ModelConfig
from cortex_worker.llm.http11 import Http11Transport
from cortex_worker.llm.reader import _Framing, _Lines
from cortex_worker.llm.stream import ModelError, Piece, TextDelta

pytestmark = pytest.mark.unit

MESSAGES = [{"role": "user", "content": "Say hello."}]
HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n")
LAST = b"0\r\n\r\n"


# -- what the servers write ------------------------------------------------------------------
def event(payload: dict[str, Any], end: bytes = b"\n") -> bytes:
    """One server-sent event; `end` is its line ending (servers use LF, CRLF or CR)."""
    return b"data: " + json.dumps(payload).encode() + end + end


def text_event(text: str, end: bytes = b"\n") -> bytes:
    return event({"choices": [{"index": 0, "delta": {"content": text}}]}, end)


FINISH = event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
DONE = b"data: [DONE]\n\n"


def chunk(data: bytes) -> bytes:
    """`data` as one HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def answer_of(texts: list[str]) -> bytes:
    """A whole chunked body: one chunk per event, then the finish, [DONE] and the last chunk."""
    return b"".join(chunk(text_event(t)) for t in texts) + chunk(FINISH) + chunk(DONE) + LAST


Answer = Callable[["RawServer", socket.socket, int], bool]
"""Writes the raw response to request number `n` (from 1); False: the connection ends."""


class RawServer:
    """An HTTP/1.1 server on loopback that keeps connections alive and writes each response
    itself (`answer`), byte for byte; counts the connections and requests it got."""

    def __init__(self, answer: Answer, tls: ssl.SSLContext | None = None) -> None:
        self.answer, self.tls = answer, tls
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = self.requests = 0
        self.release = threading.Event()  # ends a stall (set when the test is over)
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def config(self, **overrides: Any) -> ModelConfig:
        # timeout_s: a reader that loses track of a stream fails its test soon, not in 120 s
        fields: dict[str, Any] = {"max_retries": 0, "timeout_s": 5, **overrides}
        scheme = "https" if self.tls else "http"
        return ModelConfig(base_url=f"{scheme}://127.0.0.1:{self.port}/v1", model="m",
                           api_key_env=None, **fields)

    def close(self) -> None:
        self.release.set()
        self.sock.close()
        with self.lock:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small writes go now
            with self.lock:
                self.conns.append(conn)
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # OSError: the client or the test closed it
            if self.tls is not None:  # each sendall below is then one or more TLS records
                conn = self.tls.wrap_socket(conn, server_side=True)
            buffer = b""
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")[1:]
                               if line.lower().startswith(b"content-length:")), 0)
                while len(buffer) < length:
                    buffer += conn.recv(65536)
                buffer = buffer[length:]
                with self.lock:
                    self.requests += 1
                    number = self.requests
                if not self.answer(self, conn, number):
                    return


@pytest.fixture
def serve() -> Iterator[Callable[[Answer], RawServer]]:
    """Starts a `RawServer` with the given answer; closed after the test."""
    servers: list[RawServer] = []

    def start(answer: Answer) -> RawServer:
        servers.append(RawServer(answer))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    """A certificate authority of this test module's own, for TLS on loopback."""
    return trustme.CA()


@pytest.fixture
def serve_tls(ca: trustme.CA) -> Iterator[Callable[[Answer], RawServer]]:
    """`serve` over TLS, with a certificate for 127.0.0.1 from `ca`."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    servers: list[RawServer] = []

    def start(answer: Answer) -> RawServer:
        servers.append(RawServer(answer, tls=context))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def tls_client(ca: trustme.CA) -> Iterator[httpx.Client]:
    """`client`, trusting `ca` (as `Http11Transport` trusts certifi's CAs by default)."""
    context = ssl.create_default_context()
    ca.configure_trust(context)
    with httpx.Client(transport=Http11Transport(ssl_context=context)) as c:
        yield c


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    """A pool of its own (the shared client's would mix connections between tests)."""
    with httpx.Client(transport=Http11Transport()) as c:
        yield c


class Collect:
    """A `take` that keeps the text of each piece and the thread that took it; hands over
    nothing, so whatever the stream yields came from elsewhere."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.texts: list[str] = []
        self.threads: list[int] = []
        self.fail_on = fail_on

    def __call__(self, piece: Piece) -> None:
        assert isinstance(piece, TextDelta)
        self.threads.append(threading.get_ident())
        if piece.text == self.fail_on:
            raise RuntimeError(f"take refused {piece.text!r}")
        self.texts.append(piece.text)


def chat(server: RawServer, client: httpx.Client, take: Collect, **overrides: Any) -> list[Any]:
    """What `stream_chat` yields (nothing, with `Collect`)."""
    return list(gateway.stream_chat(server.config(**overrides), MESSAGES, client=client,
                                    take=take))


# -- _Framing ---------------------------------------------------------------------------------
CHUNKED = chunk(b"hello ") + b"5;name=value\r\nworld\r\n" + b"3\r\n!!!\r\n" \
    + b"0\r\nX-Checksum: abc\r\nX-Other: 1\r\n\r\n"


def test_a_chunked_body_fed_a_byte_at_a_time_is_the_body_fed_at_once() -> None:
    """Chunk extensions and trailers are skipped; `complete` only with the trailer's end."""
    whole = _Framing(chunked=True, length=None)
    assert whole.feed(CHUNKED) == b"hello world!!!"
    assert whole.complete
    bytewise = _Framing(chunked=True, length=None)
    out = []
    for i in range(len(CHUNKED)):
        assert not bytewise.complete
        out.append(bytewise.feed(CHUNKED[i:i + 1]))
    assert b"".join(out) == b"hello world!!!"
    assert bytewise.complete
    bytewise.eof()  # a close after the whole body is no error


def test_a_chunked_body_without_trailers_ends_at_the_blank_line() -> None:
    framing = _Framing(chunked=True, length=None)
    assert framing.feed(b"4\r\nab") == b"ab"
    assert framing.feed(b"cd\r\n0\r\n") == b"cd"
    assert not framing.complete  # the blank line after the (empty) trailer is still due
    assert framing.feed(b"\r\n") == b""
    assert framing.complete


def test_a_content_length_body_ends_at_its_length() -> None:
    framing = _Framing(chunked=False, length=5)
    assert framing.feed(b"hel") == b"hel"
    assert not framing.complete
    assert framing.feed(b"lo, and bytes after the body") == b"lo"
    assert framing.complete
    assert _Framing(chunked=False, length=0).complete


def test_a_body_delimited_by_the_close_ends_at_eof() -> None:
    framing = _Framing(chunked=False, length=None)
    assert framing.feed(b"abc") == b"abc"
    assert framing.feed(b"def") == b"def"
    assert not framing.complete
    framing.eof()
    assert framing.complete


@pytest.mark.parametrize(("chunked", "length", "data", "message"), [
    (True, None, b"5\r\nhel", "incomplete chunked read"),
    (True, None, b"5\r\nhello\r\n", "incomplete chunked read"),
    (False, 10, b"only6b", "4 bytes less than Content-Length"),
])
def test_a_body_cut_short_is_a_remote_protocol_error_at_eof(
        chunked: bool, length: int | None, data: bytes, message: str) -> None:
    framing = _Framing(chunked=chunked, length=length)
    framing.feed(data)
    with pytest.raises(httpx.RemoteProtocolError, match=message):
        framing.eof()


@pytest.mark.parametrize("data", [b"zz\r\n", b"\r\n", b"-5\r\nhello\r\n0\r\n\r\n",
                                  b"3\r\nabcX\r\n", b"7" * 70_000])
def test_a_malformed_chunked_body_is_a_remote_protocol_error(data: bytes) -> None:
    """A size that is not hex digits (a negative one read its framing as data), data not
    ended by CRLF, a size line that never ends: the stream fails instead of reading garbage."""
    with pytest.raises(httpx.RemoteProtocolError, match="malformed chunked body"):
        _Framing(chunked=True, length=None).feed(data)


# -- _Lines -----------------------------------------------------------------------------------
def test_a_crlf_split_between_two_reads_ends_one_line() -> None:
    lines = _Lines()
    assert lines.feed(b"data: a\r") == []
    assert lines.feed(b"\n\r") == ["data: a"]
    assert lines.feed(b"\ndata: b\r\n") == ["", "data: b"]


def test_a_lone_cr_ends_a_line() -> None:
    lines = _Lines()
    assert lines.feed(b"one\rtwo\r") == ["one"]
    assert lines.feed(b"\rthree") == ["two", ""]  # the held CR was no CRLF
    assert lines.feed(b"", final=True) == ["three"]


def test_a_character_split_between_reads_is_decoded_whole() -> None:
    data = "café ☕!\n".encode()
    lines = _Lines()
    out = [line for i in range(len(data)) for line in lines.feed(data[i:i + 1])]
    assert out == ["café ☕!"]
    assert lines.feed(b"caf\xc3") == []
    assert lines.feed(b"\xa9\xf0\x9f") == []
    assert lines.feed(b"\x98\x80\n") == ["café😀"]


# -- whole streams ------------------------------------------------------------------------------
AWKWARD = ["Hel", "lo", ", wor", "ld — ", "café ☕", " and", " more", " text", ".\n", "Bye"]


def test_a_stream_written_in_awkward_pieces_reaches_take_whole(
        serve: Callable[[Answer], RawServer], client: httpx.Client) -> None:
    """The head and the first events in one write; the rest chunked across SSE lines (and
    UTF-8 characters), with CRLF, CR and a comment among the events, written a few bytes at
    a time: mid chunk size, mid line, mid CRLF. The pieces after the head are taken on the
    reader thread."""
    events = (text_event(AWKWARD[2], b"\r\n") + b": keep-alive\n\n" + text_event(AWKWARD[3])
              + text_event(AWKWARD[4], b"\r") + b"".join(text_event(t) for t in AWKWARD[5:])
              + FINISH + DONE)
    body = b"".join(chunk(events[i:i + 11]) for i in range(0, len(events), 11)) + LAST

    def answer(server: RawServer, conn: socket.socket, n: int) -> bool:
        conn.sendall(HEAD + chunk(text_event(AWKWARD[0]) + text_event(AWKWARD[1])))
        time.sleep(0.05)
        at, sizes = 0, [1, 2, 3, 5, 8, 13]
        while at < len(body):
            size = sizes[at % len(sizes)]
            conn.sendall(body[at:at + size])
            at += size
            time.sleep(0.001)
        return True

    server = serve(answer)
    take = Collect()
    assert chat(server, client, take) == []  # take handed nothing over
    assert take.texts == AWKWARD
    later = set(take.threads[2:])
    assert len(later) == 1
    assert later != {threading.get_ident()}


class OneAtATime:
    """A `take` that hands over every 3rd piece; notes every piece it was given and whether
    another thread was in it at the same time."""

    def __init__(self) -> None:
        self.guard = threading.Lock()
        self.texts: list[str] = []
        self.threads: list[int] = []  # of each piece
        self.overlaps = 0

    def __call__(self, piece: Piece) -> str | None:
        if not self.guard.acquire(blocking=False):
            self.overlaps += 1
            return None
        try:
            assert isinstance(piece, TextDelta)
            self.texts.append(piece.text)
            self.threads.append(threading.get_ident())
            time.sleep(0.0002)  # a wider window for another thread to come in
            return piece.text if len(self.texts) % 3 == 0 else None
        finally:
            self.guard.release()


def test_pieces_reach_take_once_in_order_and_one_at_a_time_across_the_hand_over(
        serve: Callable[[Answer], RawServer], client: httpx.Client) -> None:
    """While the caller's thread deals with a handed-over value, the reader queues the later
    pieces and the caller's thread takes them itself, then gives `take` back to the reader
    once caught up. Bursts of pieces make the first happen (a burst arrives at once, a value
    is handed over in it, and the caller is busy with it while the rest waits); the server
    sends each burst only once every piece before it was taken, so the caller has caught up
    and the burst's first piece goes to the reader: the second happens too, on any machine."""
    texts = [f"p{i:03d} " for i in range(90)]
    take = OneAtATime()

    def answer(server: RawServer, conn: socket.socket, n: int) -> bool:
        conn.sendall(HEAD)
        at, burst = 0, 1
        while at < len(texts):
            deadline = time.monotonic() + 30  # a backstop: the client stopped taking
            while (len(take.texts) < at or len(done) < at // 3) and time.monotonic() < deadline:
                time.sleep(0.001)  # until every piece was taken and every value dealt with
            time.sleep(0.002)  # the caller's thread, caught up, waits for the next piece
            conn.sendall(b"".join(chunk(text_event(t)) for t in texts[at:at + burst]))
            at, burst = at + burst, burst % 7 + 1
        conn.sendall(chunk(FINISH) + chunk(DONE) + LAST)
        return True

    server = serve(answer)
    handed, done = [], []
    for value in gateway.stream_chat(server.config(), MESSAGES, client=client, take=take):
        handed.append(value)
        time.sleep(0.005)  # the caller's thread is busy: the reader holds what comes meanwhile
        done.append(value)
    assert take.overlaps == 0
    assert take.texts == texts
    assert handed == texts[2::3]
    caller = threading.get_ident()
    first_by_caller = take.threads.index(caller)
    assert any(t != caller for t in take.threads[first_by_caller:])  # taken back by the reader
    assert len(set(take.threads)) == 2


def test_a_body_cut_short_fails_after_the_pieces_before_it(
        serve: Callable[[Answer], RawServer], client: httpx.Client) -> None:
    def answer(server: RawServer, conn: socket.socket, n: int) -> bool:
        conn.sendall(HEAD + chunk(text_event("ab")))
        time.sleep(0.05)
        conn.sendall(chunk(text_event("cd")) + b"20\r\ndata: {\"cho")
        time.sleep(0.05)
        return False  # closed: no last chunk, no finish_reason

    server = serve(answer)
    take = Collect()
    with pytest.raises(ModelError, match="closed the connection mid-response") as info:
        chat(server, client, take)
    assert take.texts == ["ab", "cd"]
    assert info.value.retryable
    assert info.value.streamed == 4
    assert server.requests == 1


def test_a_body_cut_short_before_any_piece_is_retried(
        serve: Callable[[Answer], RawServer], client: httpx.Client,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport, "_sleep", lambda s: None)

    def answer(server: RawServer, conn: socket.socket, n: int) -> bool:
        if n == 1:  # the role, no text yet, then the connection drops
            conn.sendall(HEAD)
            time.sleep(0.02)
            conn.sendall(chunk(event({"choices": [{"index": 0,
                                                   "delta": {"role": "assistant"}}]})))
            time.sleep(0.02)
            return False
        conn.sendall(HEAD + answer_of(["second ", "time"]))
        return True

    server = serve(answer)
    take = Collect()
    assert chat(server, client, take, max_retries=2) == []
    assert take.texts == ["second ", "time"]
    assert (server.requests, server.connections) == (2, 2)


def test_an_event_the_decoder_rejects_fails_after_the_pieces_before_it(
        serve: Callable[[Answer], RawServer], client: httpx.Client) -> None:
    def answer(server: RawServer, conn: socket.socket, n: int) -> bool:
        conn.sendall(HEAD + chunk(text_event("ok")))
        time.sleep(0.03)
        conn.sendall(chunk(text_event("fine") + b"data: {not json\n\n" + text_event("never")))
        return True

    server = serve(answer)
    take = Collect()
    with pytest.raises(ModelError, match="not JSON"):
        chat(server, client, take)
    assert take.texts == ["ok", "fine"]


def test_a_stall_is_a_timeout_after_timeout_s(
        serve: Callable[[Answer], RawServer], client: httpx.Client) -> None:
    def answer(server: RawServer, conn: socket.socket, n: int) -> bool:
        conn.sendall(HEAD + chunk(text_event("a")))
        time.sleep(0.05)
        conn.sendall(chunk(text_event("b")))
        server.release.wait(5)  # silent, the connection open
        return False

    server = serve(answer)
    take = Collect()
    # the message names the timer that fired: the read timeout (timeout_s), not the server
    # closing the connection when its stall ends ("closed the connection mid-response")
    with pytest.raises(ModelError, match=r"sent nothing for 0\.5 s \(timeout_s\)") as info:
        chat(server, client, take, timeout_s=0.5)
    assert take.texts == ["a", "b"]  # it fired in the silence after "b", not before
    assert info.value.retryable
    assert (info.value.streamed, info.value.attempts, server.requests) == (2, 1, 1)


def test_a_stream_read_to_its_end_leaves_its_connection_for_the_next(
        serve: Callable[[Answer], RawServer], client: httpx.Client) -> None:
    def answer(server: RawServer, conn: socket.socket, n: int) -> bool:
        conn.sendall(HEAD + chunk(text_event(f"answer {n}")))
        time.sleep(0.02)
        conn.sendall(chunk(text_event(", the end")) + chunk(FINISH))
        time.sleep(0.02)
        conn.sendall(chunk(DONE) + LAST)
        return True

    server = serve(answer)
    for n in (1, 2, 3):
        take = Collect()
        chat(server, client, take)
        assert take.texts == [f"answer {n}", ", the end"]
    assert (server.requests, server.connections) == (3, 1)


def test_a_body_end_sent_after_done_still_keeps_the_connection(
        serve: Callable[[Answer], RawServer], client: httpx.Client,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Servers write `[DONE]` and the body's last chunk apart: the reader reads on to that
    chunk (within `_DRAIN_S`, made long here so that a busy machine's scheduling cannot
    decide), so the next turn's request reuses the connection."""
    monkeypatch.setattr(reader, "_DRAIN_S", 30.0)

    def answer(server: RawServer, conn: socket.socket, n: int) -> bool:
        conn.sendall(HEAD + chunk(text_event(f"answer {n}")) + chunk(FINISH) + chunk(DONE))
        time.sleep(0.03)
        conn.sendall(LAST)
        return True

    server = serve(answer)
    for n in (1, 2):
        take = Collect()
        chat(server, client, take)
        assert take.texts == [f"answer {n}"]
    assert (server.requests, server.connections) == (2, 1)


def test_a_body_whose_end_never_comes_after_done_ends_and_its_connection_is_dropped(
        serve: Callable[[Answer], RawServer], client: httpx.Client) -> None:
    """A server that never ends the body after `[DONE]` costs the turn about `_DRAIN_S`
    plus a sweep (not the read timeout: the stream ends well before it), and a fresh
    connection for the next request."""
    def answer(server: RawServer, conn: socket.socket, n: int) -> bool:
        conn.sendall(HEAD + chunk(text_event(f"answer {n}")) + chunk(FINISH) + chunk(DONE))
        return True  # no last chunk: the connection stays open, the body unfinished

    server = serve(answer)
    for n in (1, 2):
        take = Collect()
        # the read timeout is an hour: only the drain can end this stream while the test
        # runs (without it, the test would hang there)
        chat(server, client, take, timeout_s=3600)
        assert take.texts == [f"answer {n}"]
    assert (server.requests, server.connections) == (2, 2)  # each dropped after its drain


@pytest.mark.parametrize("stop", ["break", "close"])
def test_a_stream_closed_early_closes_its_connection(
        serve: Callable[[Answer], RawServer], client: httpx.Client, stop: str) -> None:
    def answer(server: RawServer, conn: socket.socket, n: int) -> bool:
        if n == 1:
            conn.sendall(HEAD + chunk(text_event("first")))
            for i in range(100):  # more, until the client has gone
                time.sleep(0.01)
                conn.sendall(chunk(text_event(f" {i}")))
            return False
        conn.sendall(HEAD + answer_of(["fresh"]))
        return True

    server = serve(answer)
    gen = gateway.stream_chat(server.config(), MESSAGES, client=client)
    if stop == "break":
        for piece in gen:
            assert piece == TextDelta("first")
            break
        del gen  # dropped: closed as CPython frees it
    else:
        assert next(gen) == TextDelta("first")
        gen.close()
    take = Collect()
    chat(server, client, take)
    assert take.texts == ["fresh"]
    assert (server.requests, server.connections) == (2, 2)


def test_an_exception_in_take_on_the_reader_thread_reaches_the_caller(
        serve: Callable[[Answer], RawServer], client: httpx.Client) -> None:
    """... as that exception; the reader goes on serving the next stream."""
    def answer(server: RawServer, conn: socket.socket, n: int) -> bool:
        conn.sendall(HEAD + chunk(text_event(f"{n}:a")))
        time.sleep(0.05)
        conn.sendall(chunk(text_event(f"{n}:boom")))
        time.sleep(0.02)
        conn.sendall(chunk(text_event(f"{n}:c")) + chunk(FINISH) + chunk(DONE) + LAST)
        return True

    server = serve(answer)
    take = Collect(fail_on="1:boom")
    with pytest.raises(RuntimeError, match="take refused '1:boom'"):
        chat(server, client, take)
    assert take.texts == ["1:a"]
    assert take.threads[1] != threading.get_ident()  # raised on the reader thread
    the_reader = reader._shared_reader()
    take = Collect()
    chat(server, client, take)
    assert take.texts == ["2:a", "2:boom", "2:c"]
    assert reader._shared_reader() is the_reader and the_reader.alive()


def test_streams_readable_often_gather_between_wakes_and_each_reaches_take_whole(
        serve: Callable[[Answer], RawServer], client: httpx.Client) -> None:
    """Many streams readable at once (here about 4,800 times a second, above `_GATHERED` per
    `_GATHER_S`): the reader lets data gather between its wakes, so that one wake reads many
    streams, and every stream still reaches `take` whole and in order, in the reader thread.
    Once they end, it waits for data as soon as it comes again."""
    texts = [f"t{i:03d} " for i in range(200)]

    def answer(server: RawServer, conn: socket.socket, n: int) -> bool:
        conn.sendall(HEAD)
        for text in texts:
            time.sleep(0.005)
            conn.sendall(chunk(text_event(text)))
        conn.sendall(chunk(FINISH) + chunk(DONE) + LAST)
        return True

    server = serve(answer)
    takes = [Collect() for _ in range(24)]
    threads = [threading.Thread(target=chat, args=(server, client, take)) for take in takes]
    for thread in threads:
        thread.start()
    busy = []
    while any(thread.is_alive() for thread in threads):
        busy.append(reader._shared_reader().busy)
        time.sleep(0.05)
    assert all(take.texts == texts for take in takes)
    assert all(threading.get_ident() not in take.threads for take in takes)
    assert True in busy
    # the next sweeps see no streams readable (within a few of them on a loaded machine)
    deadline = time.monotonic() + 20 * reader._SWEEP_S
    while reader._shared_reader().busy and time.monotonic() < deadline:
        time.sleep(reader._SWEEP_S / 5)
    assert not reader._shared_reader().busy


# -- TLS: what every stream from a hosted model goes through --------------------------------
def test_a_tls_stream_in_awkward_records_reaches_take_whole_and_keeps_its_connection(
        serve_tls: Callable[[Answer], RawServer], tls_client: httpx.Client) -> None:
    """Over TLS each write is a record of its own: records that end mid chunk size, mid line
    and mid UTF-8 character; a burst of many records at once; an event larger than a record
    (16 KiB), so that decrypted data waits in the TLS buffer, where epoll cannot see it. The
    reader takes them all, in order, and reads the body to its end, so the next request rides
    the same connection."""
    big = "x" * 40_000 + "é"
    texts = ["héllo", " wörld", *[f" {i}" for i in range(60)], big, " end"]
    events = b"".join(text_event(t) for t in texts) + FINISH + DONE
    body = b"".join(chunk(events[i:i + 7]) for i in range(0, 196, 7)) + chunk(events[196:]) + LAST

    def answer(server: RawServer, conn: socket.socket, n: int) -> bool:
        conn.sendall(HEAD)
        at = 0
        for size in [1, 2, 3, 5, 8, 13, 21, 34]:  # record by record, a little apart
            conn.sendall(body[at:at + size])
            at += size
            time.sleep(0.002)
        burst = body[at:len(body) - 50_000]  # many records in one go
        for i in range(0, len(burst), 40):
            conn.sendall(burst[i:i + 40])
        conn.sendall(body[len(body) - 50_000:])  # the big event: several full records
        return True

    server = serve_tls(answer)
    for _ in range(2):
        take = Collect()
        assert chat(server, tls_client, take) == []
        assert take.texts == texts
    assert (server.requests, server.connections) == (2, 1)


def test_a_tls_stream_cut_short_fails_after_the_pieces_before_it(
        serve_tls: Callable[[Answer], RawServer], tls_client: httpx.Client) -> None:
    """The server closes the TLS connection mid body: the pieces before reach `take`, then
    the stream fails with an HTTP error, as over plain TCP."""
    def answer(server: RawServer, conn: socket.socket, n: int) -> bool:
        conn.sendall(HEAD + chunk(text_event("one")) + chunk(text_event("two")))
        time.sleep(0.05)
        conn.sendall(b"40\r\n" + b"data: {")  # a chunk cut short, then the close
        return False

    server = serve_tls(answer)
    take = Collect()
    with pytest.raises((httpx.HTTPError, ModelError)):
        chat(server, tls_client, take)
    assert take.texts == ["one", "two"]


def test_as_many_streams_as_the_agent_pool_has_threads_keep_their_connections(
        serve: Callable[[Answer], RawServer]) -> None:
    """The shared client keeps a connection per thread of the agent pool as shipped: 120
    streams at once (more than the 50 it kept before), then 120 more, open no new
    connection (to a hosted model, each would be a TCP and a TLS handshake)."""
    all_open = threading.Barrier(120)  # a round's answers end once all its streams are open

    def answer(server: RawServer, conn: socket.socket, n: int) -> bool:
        conn.sendall(HEAD + chunk(text_event("hi")))
        all_open.wait(timeout=60)
        conn.sendall(chunk(FINISH) + chunk(DONE) + LAST)
        return True

    server = serve(answer)
    with httpx.Client(transport=Http11Transport()) as client:  # as `shared_client` has it
        for _ in range(2):
            takes = [Collect() for _ in range(120)]
            threads = [threading.Thread(target=chat, args=(server, client, take))
                       for take in takes]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert all(take.texts == ["hi"] for take in takes)
    assert (server.requests, server.connections) == (240, 120)
