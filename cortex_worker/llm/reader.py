"""One thread reads every model stream of this process.

A caller's thread sends the request and reads the answer's head (`Http11Transport`); `follow`
then hands the connection to this process's reader thread. It waits on every stream's socket
at once (epoll), undoes the HTTP framing, splits the server-sent events, decodes them into
pieces (the provider's `transport.Decoder`) and gives each piece to the caller's `take`,
in the reader thread. `take` deals with a piece there (returns None: the coordinator parses
the text and queues its chunks for logging), or returns work for the caller's thread, which
`follow` yields there. The stream then holds its later pieces for the caller's thread, which
gives them to `take` itself until it has caught up: pieces reach `take` one at a time, in
order, whichever thread runs it. So a turn's thread wakes when there is something only it can
do (register an action, end the turn), not for every token: with one thread reading each
stream, waking a thread per token cost more CPU than the token's own work
(docs/performance.md, "One reader thread").

A connection that `follow` cannot hand over (httpx's own transport, where a proxy is set; a
test's mock transport) is read in the caller's thread, with the same decoder and `take`.
"""

from __future__ import annotations

import codecs
import contextlib
import logging
import os
import select
import ssl
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Generic

import httpx

from cortex_worker.llm.http11 import Body
from cortex_worker.llm.sse import Decoder, SSEParser, T, Take, decode_lines, taken
from cortex_worker.llm.stream import Piece

__all__ = ["follow"]

log = logging.getLogger(__name__)

_READ = 64 * 1024
_SWEEP_S = 0.25  # how often read deadlines are checked
_WAIT_S = 1.0  # how often a waiting caller checks that the reader thread is alive
_HEX = b"0123456789abcdefABCDEF"
# A wake of the reader costs more CPU than reading a token (docs/performance.md): when streams
# are readable often enough that `_GATHERED` of them would be in `_GATHER_S`, the reader lets
# data gather that long before each wait, so one wake reads many streams.
_GATHER_S = 0.002
_GATHERED = 2
_DRAIN_S = 0.25  # how long the end of a body may lag behind the answer's last event


def follow(response: httpx.Response, decoder: Decoder, take: Take[T]) -> Iterator[T]:
    """Give each piece of the streamed `response` to `take` and yield what it hands back.

    Raises what the stream raises (`httpx.HTTPError`, `ModelError`), after every piece before
    the failure was taken. Closing the generator stops the stream at once."""
    body = response.extensions.get("cortex.body")
    if not isinstance(body, Body):  # a connection the reader cannot follow: read it here
        yield from taken(decode_lines(decoder, response.iter_lines()), take)
        return
    stream = _Stream(body, decoder, take, response.request)
    reader = _shared_reader()
    reader.add(stream)
    try:
        yield from stream.results(reader)
    finally:
        reader.drop(stream)
        body.reattach(complete=stream.complete)


class _Work(Generic[T]):
    """What `take` returned: work for the caller's thread."""

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value = value


class _Framing:
    """An HTTP/1.1 body as it arrives: chunked, `Content-Length` bytes, or up to the close."""

    __slots__ = ("buffer", "chunked", "complete", "left", "state")

    def __init__(self, chunked: bool, length: int | None) -> None:
        self.chunked, self.left = chunked, length
        self.buffer = b""
        self.state = "size"  # chunked: size, data, crlf, trailer
        self.complete = not chunked and length == 0

    def feed(self, data: bytes) -> bytes:
        """The body bytes in `data`; sets `complete` at the body's end."""
        if not self.chunked:
            if self.left is None:
                return data
            data = data[:self.left]
            self.left -= len(data)
            self.complete = self.left == 0
            return data
        buffer = self.buffer + data if self.buffer else data
        out: list[bytes] = []
        at = 0
        while not self.complete:
            if self.state == "data":
                part = buffer[at:at + self.left]
                out.append(part)
                at += len(part)
                self.left -= len(part)
                if self.left:
                    break
                self.state = "crlf"
            end = buffer.find(b"\n", at)
            if end < 0:
                break
            line = buffer[at:end].rstrip(b"\r")
            at = end + 1
            if self.state == "crlf":
                if line:
                    raise httpx.RemoteProtocolError("malformed chunked body: no CRLF after a chunk")
                self.state = "size"
            elif self.state == "size":
                size = line.split(b";", 1)[0].strip()
                if not size or size.strip(_HEX):  # int() would take "-5", "+5", "0x5", "5_0"
                    raise httpx.RemoteProtocolError(
                        f"malformed chunked body: chunk size {line[:20]!r}")
                self.left = int(size, 16)
                self.state = "data" if self.left else "trailer"
            elif not line:  # the blank line after the trailer
                self.complete = True
        self.buffer = buffer[at:]
        if len(self.buffer) > 64 * 1024:
            raise httpx.RemoteProtocolError("malformed chunked body: a line over 64 KiB")
        return b"".join(out)

    def eof(self) -> None:
        """The server closed the connection: the end of the body, if it was whole."""
        if self.complete:
            return
        if self.chunked:
            raise httpx.RemoteProtocolError("peer closed connection without sending complete "
                                            "message body (incomplete chunked read)")
        if self.left:
            raise httpx.RemoteProtocolError(
                f"peer closed connection without sending complete message body (received "
                f"{self.left} bytes less than Content-Length)")
        self.complete = True


class _Lines:
    """Text lines (ended by LF, CRLF or CR) of UTF-8 bytes as they arrive."""

    __slots__ = ("decode", "rest")

    def __init__(self) -> None:
        self.decode = codecs.getincrementaldecoder("utf-8")("replace").decode
        self.rest = ""

    def feed(self, data: bytes, final: bool = False) -> list[str]:
        text = self.rest + self.decode(data, final)
        if "\r" in text:
            held = text.endswith("\r") and not final  # maybe the first half of CRLF
            text = text[:-1] if held else text
            text = text.replace("\r\n", "\n").replace("\r", "\n") + ("\r" if held else "")
        lines = text.split("\n")
        self.rest = lines.pop()
        if final and self.rest:
            lines.append(self.rest)
            self.rest = ""
        return lines


class _Stream(Generic[T]):
    """One followed response: what the reader read, and who gives pieces to `take` now."""

    def __init__(self, body: Body, decoder: Decoder, take: Take[T],
                 request: httpx.Request) -> None:
        self.decoder, self.take, self.request = decoder, take, request
        self.sock, buffered, chunked, length = body.detach()
        self.fd = self.sock.fileno()
        self.tls = isinstance(self.sock, ssl.SSLSocket)
        self.framing = _Framing(chunked, length)
        self.lines = _Lines()
        self.sse = SSEParser()
        read = (request.extensions.get("timeout") or {}).get("read")
        self.read_s: float | None = read
        self.deadline = time.monotonic() + read if read is not None else None
        self.lock = threading.Lock()
        self.ready = threading.Condition(self.lock)
        self.queue: deque[Piece | _Work[T]] = deque()  # for the caller's thread, in order
        self.held = False  # the caller's thread gives pieces to `take`: the reader queues them
        self.over = False  # nothing more will be read (the end, a failure, or closed)
        self.error: BaseException | None = None
        self.pending = buffered  # read with the head, decoded on the reader's first turn
        self.drain_until: float | None = None  # the answer is whole; its body's end is due

    @property
    def complete(self) -> bool:
        """The body was read to its end (its connection can serve another request)."""
        return self.framing.complete and self.error is None

    # -- the reader thread ---------------------------------------------------------------
    def readable(self) -> None:
        """Read what arrived, decode it and give its pieces to `take` (or queue them)."""
        with self.lock:
            if self.over:
                return
            pieces: list[Piece] = []
            try:
                if self.pending:  # what came with the head, before anything read after it
                    data, self.pending = self.pending, b""
                    self._decode(data, pieces)
                if not self.over:
                    self._decode(self._recv(), pieces)
            except BaseException as exc:
                if isinstance(exc, httpx.HTTPError) and self.decoder.finished:
                    self._end(pieces)  # only the trailer (usage) is lost
                else:
                    self.error = exc
                    self.over = True
            self._give(pieces)
            if self.held or self.over:
                self.ready.notify()

    def expire(self, now: float) -> None:
        """Fail the stream if nothing arrived for `read_s`; end it if the body's end did not
        follow the answer's within `_DRAIN_S` (its connection is then closed)."""
        with self.lock:
            if self.over:
                return
            pieces: list[Piece] = []
            if self.drain_until is not None:
                if now < self.drain_until:
                    return
                self._end(pieces)
            elif self.deadline is None or now < self.deadline:
                return
            elif self.decoder.finished:
                self._end(pieces)
            else:
                self.error = httpx.ReadTimeout(f"no data for {self.read_s:g} s",
                                               request=self.request)
                self.over = True
            self._give(pieces)
            self.ready.notify()

    def _recv(self) -> bytes:
        try:
            data = self.sock.recv(_READ)
            while self.tls and data and self.sock.pending():  # decrypted, not signalled by epoll
                data += self.sock.recv(_READ)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return b""
        except OSError as exc:
            raise httpx.ReadError(str(exc), request=self.request) from exc
        if not data:
            self.framing.eof()  # raises if the body was cut short
        elif self.read_s is not None:
            self.deadline = time.monotonic() + self.read_s
        return data

    def _decode(self, data: bytes, pieces: list[Piece]) -> None:
        if self.drain_until is not None:  # the answer is whole: only the body's end is awaited
            self.framing.feed(data)
            if self.framing.complete:
                self._end(pieces)
            return
        line_event, decode = self.sse.line, self.decoder.event
        for line in self.lines.feed(self.framing.feed(data)) if data else ():
            event = line_event(line)
            if event is not None:
                pieces.extend(decode(*event))
                if self.decoder.done:  # ([DONE], message_stop) read on to the body's end, so
                    if self.framing.complete:  # that its connection serves the next request
                        self._end(pieces)
                    else:
                        self.drain_until = time.monotonic() + _DRAIN_S
                    return
        if self.framing.complete:  # the last line, and the end of its event
            for line in [*self.lines.feed(b"", final=True), ""]:
                event = line_event(line)
                if event is not None and not self.decoder.done:
                    pieces.extend(decode(*event))
            self._end(pieces)

    def _end(self, pieces: list[Piece]) -> None:
        self.over = True
        try:
            pieces.extend(self.decoder.end())
        except BaseException as exc:
            self.error = exc

    def _give(self, pieces: list[Piece]) -> None:
        """Each piece to `take`, unless the caller's thread holds the stream (queue it)."""
        for piece in pieces:
            if self.held:
                self.queue.append(piece)
                continue
            try:
                work = self.take(piece)
            except BaseException as exc:
                self.error, self.over = exc, True
                return
            if work is not None:
                self.queue.append(_Work(work))
                self.held = True

    # -- the caller's thread ---------------------------------------------------------------
    def results(self, reader: _Reader) -> Iterator[T]:
        while True:
            with self.lock:
                while not self.queue:
                    if self.over:
                        if self.error is not None:
                            raise self.error
                        return
                    self.held = False  # caught up: the reader gives pieces to `take` again
                    if not self.ready.wait(_WAIT_S) and not reader.alive():
                        raise httpx.ReadError("the stream reader thread stopped",
                                              request=self.request)
                item = self.queue.popleft()
            if isinstance(item, _Work):
                yield item.value
                continue
            work = self.take(item)  # held: the reader queues pieces meanwhile
            if work is not None:
                yield work


class _Reader:
    """The process's reader thread: epoll over every followed stream's socket."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.poll = select.epoll()
        self.streams: dict[int, _Stream[Any]] = {}
        self.lock = threading.Lock()  # guards `streams`
        self.busy = False  # streams are so often readable that data gathers between wakes
        self.thread = threading.Thread(target=self._run, name="cortex-model-streams",
                                       daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def add(self, stream: _Stream[Any]) -> None:
        with self.lock:
            self.streams[stream.fd] = stream
            self.poll.register(stream.fd, select.EPOLLIN)
        stream.readable()  # what came with the head (or sits decrypted in TLS): now
        if stream.over:
            self.drop(stream)

    def drop(self, stream: _Stream[Any]) -> None:
        """Stop reading `stream` (its socket goes back to its connection)."""
        with stream.lock:
            stream.over = True
        with self.lock:
            if self.streams.get(stream.fd) is stream:
                del self.streams[stream.fd]
                with contextlib.suppress(OSError, ValueError):
                    self.poll.unregister(stream.fd)

    def _run(self) -> None:
        swept = time.monotonic()
        seen = 0  # streams found readable since `swept`
        while True:
            try:
                if self.busy:
                    time.sleep(_GATHER_S)
                ready = self.poll.poll(_SWEEP_S)
                seen += len(ready)
                for fd, _ in ready:
                    stream = self.streams.get(fd)
                    if stream is not None:
                        stream.readable()
                        if stream.over:
                            self.drop(stream)
                now = time.monotonic()
                if now - swept >= _SWEEP_S:
                    self.busy = seen * _GATHER_S >= _GATHERED * (now - swept)
                    swept, seen = now, 0
                    for stream in list(self.streams.values()):
                        stream.expire(now)
                        if stream.over:
                            self.drop(stream)
            except Exception:  # never let a bug stop every stream of the process
                log.exception("the model stream reader failed; it goes on")


class _Current:
    """This process's reader (a forked child makes its own)."""

    def __init__(self) -> None:
        self.reader: _Reader | None = None
        self.lock = threading.Lock()


_current = _Current()


def _shared_reader() -> _Reader:
    """This process's reader (a forked child starts its own)."""
    with _current.lock:
        reader = _current.reader
        if reader is None or reader.pid != os.getpid() or not reader.alive():
            reader = _current.reader = _Reader()
        return reader

