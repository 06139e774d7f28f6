"""An httpx transport over the standard library's `http.client`, for model streams.

httpx's own transport hands each chunk of a response through httpcore and h11: about 20 µs
of Python per streamed token, the largest share of what an agent worker spends on a token
(docs/performance.md). `http.client` reads a chunked body with the C buffered reader. Model
streams are plain HTTP/1.1 requests, each many tokens long, so the gateway's client
(`transport.shared_client`) sends them through `Http11Transport` behind the same `httpx.Client`
API: the same `Response`, the same exceptions (`httpx.ConnectError`, `ReadTimeout`,
`RemoteProtocolError`, ...), keep-alive connections pooled per origin.

Timeouts: `connect` while connecting, `write` while sending, `read` for each read after.
TLS: httpx's default context (`httpx.create_ssl_context()`: certifi, `SSL_CERT_FILE`). Proxies
from the environment are not this transport's: `shared_client` keeps httpx's own transport
where one is configured.
"""

from __future__ import annotations

import http.client
import select
import socket
import ssl
import threading
from collections.abc import Iterator

import httpx

from cortex_worker.settings import AGENT_THREADS

__all__ = ["Body", "Http11Transport"]

Origin = tuple[str, str, int]
_READ = 64 * 1024
_PORTS = {"http": 80, "https": 443}
#: Kept-alive connections per origin: one per thread of the agent pool as shipped, so that each
#: turn's next request finds its connection open (a new one to a hosted model costs a TCP and a
#: TLS handshake).
MAX_IDLE = AGENT_THREADS


class Http11Transport(httpx.BaseTransport):
    """HTTP/1.1 over `http.client`, with up to `max_idle` kept-alive connections per origin."""

    def __init__(self, *, max_idle: int = MAX_IDLE, ssl_context: ssl.SSLContext | None = None) -> None:
        self.max_idle = max_idle
        self._ssl = ssl_context
        self._idle: dict[Origin, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme not in _PORTS:
            raise httpx.UnsupportedProtocol(f"unsupported URL scheme {url.scheme!r}",
                                            request=request)
        origin = (url.scheme, url.host, url.port or _PORTS[url.scheme])
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        body = request.read()
        while True:
            conn, reused = self._checkout(origin, timeouts, request)
            sock = conn.sock  # the response holds it alone when the server closes after it
            try:
                response = self._send(conn, request, body, timeouts)
            except _Stale:
                conn.close()
                if reused:
                    continue  # a kept-alive connection the server had closed: once more, anew
                raise httpx.RemoteProtocolError("the server closed the connection without "
                                                "answering", request=request) from None
            except BaseException:
                conn.close()
                raise
            stream = Body(self, origin, conn, sock, response, request)
            return httpx.Response(
                response.status, headers=response.getheaders(), stream=stream,
                extensions={"http_version": b"HTTP/1.1", "cortex.body": stream,
                            "reason_phrase": response.reason.encode("latin-1", "replace")})

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    # -- connections -------------------------------------------------------------------------
    def _checkout(self, origin: Origin, timeouts: dict[str, float | None],
                  request: httpx.Request) -> tuple[http.client.HTTPConnection, bool]:
        """A kept-alive connection of `origin` (the server has not closed it), else a new one."""
        while True:
            with self._lock:
                conns = self._idle.get(origin)
                conn = conns.pop() if conns else None
            if conn is None:
                return self._connect(origin, timeouts, request), False
            if conn.sock is not None and not select.select([conn.sock], [], [], 0)[0]:
                return conn, True
            conn.close()  # readable while idle: closed by the server (or garbage): drop it

    def _connect(self, origin: Origin, timeouts: dict[str, float | None],
                 request: httpx.Request) -> http.client.HTTPConnection:
        scheme, host, port = origin
        conn: http.client.HTTPConnection
        if scheme == "https":
            if self._ssl is None:
                self._ssl = httpx.create_ssl_context()
            conn = http.client.HTTPSConnection(host, port, timeout=timeouts.get("connect"),
                                               context=self._ssl)
        else:
            conn = http.client.HTTPConnection(host, port, timeout=timeouts.get("connect"))
        try:
            conn.connect()
        except TimeoutError as exc:
            conn.close()
            raise httpx.ConnectTimeout(str(exc) or "timed out", request=request) from exc
        except OSError as exc:  # refused, unreachable, name not found, TLS failure
            conn.close()
            raise httpx.ConnectError(str(exc), request=request) from exc
        assert conn.sock is not None
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _release(self, origin: Origin, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            conns = self._idle.setdefault(origin, [])
            if len(conns) < self.max_idle:
                conns.append(conn)
                return
        conn.close()

    @staticmethod
    def _send(conn: http.client.HTTPConnection, request: httpx.Request, body: bytes,
              timeouts: dict[str, float | None]) -> http.client.HTTPResponse:
        """Send the request and read the response's head; raises `_Stale` when the server
        closed the connection before it answered anything."""
        assert conn.sock is not None
        try:
            conn.sock.settimeout(timeouts.get("write"))
            conn.putrequest(request.method, request.url.raw_path.decode("ascii"),
                            skip_host=True, skip_accept_encoding=True)
            for name, value in request.headers.multi_items():
                conn.putheader(name, value)
            conn.endheaders(body or None)
        except TimeoutError as exc:
            raise httpx.WriteTimeout(str(exc) or "timed out", request=request) from exc
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise _Stale from exc
        except OSError as exc:
            raise httpx.WriteError(str(exc), request=request) from exc
        try:
            conn.sock.settimeout(timeouts.get("read"))
            return conn.getresponse()
        except TimeoutError as exc:
            raise httpx.ReadTimeout(str(exc) or "timed out", request=request) from exc
        except (http.client.RemoteDisconnected, ConnectionResetError) as exc:
            raise _Stale from exc
        except http.client.HTTPException as exc:
            raise httpx.RemoteProtocolError(f"invalid response: {exc!r}", request=request) from exc
        except OSError as exc:
            raise httpx.ReadError(str(exc), request=request) from exc


class _Stale(Exception):
    """The connection was closed before any of the response arrived."""


class Body(httpx.SyncByteStream):
    """A response body as it arrives (chunked encoding undone), or handed to a reader thread
    (`detach`, the response's extension `cortex.body`); its connection goes back to the pool
    once the body was read to its end, else it is closed."""

    def __init__(self, transport: Http11Transport, origin: Origin,
                 conn: http.client.HTTPConnection, sock: socket.socket | None,
                 response: http.client.HTTPResponse, request: httpx.Request) -> None:
        self.transport, self.origin, self.conn, self.sock = transport, origin, conn, sock
        self.response, self.request = response, request
        self.complete = self.closed = False

    def __iter__(self) -> Iterator[bytes]:
        read = self.response.read1
        try:
            while chunk := read(_READ):
                yield chunk
        except TimeoutError as exc:
            raise httpx.ReadTimeout(str(exc) or "timed out", request=self.request) from exc
        except http.client.IncompleteRead as exc:
            raise httpx.RemoteProtocolError(
                "peer closed connection without sending complete message body "
                "(incomplete chunked read)", request=self.request) from exc
        except http.client.HTTPException as exc:
            raise httpx.RemoteProtocolError(f"invalid response body: {exc!r}",
                                            request=self.request) from exc
        except OSError as exc:
            raise httpx.ReadError(str(exc), request=self.request) from exc
        if self.response.length:  # Content-Length bytes still missing
            raise httpx.RemoteProtocolError(
                f"peer closed connection without sending complete message body (received "
                f"{self.response.length} bytes less than Content-Length)", request=self.request)
        self.response.close()  # read to its end: the connection may send the next request
        self.complete = True

    def detach(self) -> tuple[socket.socket, bytes, bool, int | None]:
        """Hand the body to a reader of its own (`reader.follow`): the non-blocking socket,
        the bytes read with the head, whether the body is chunked, its Content-Length."""
        sock, fp = self.sock, self.response.fp
        assert sock is not None
        sock.setblocking(False)
        try:
            buffered = fp.read1(_READ) or b"" if fp is not None else b""
        except (BlockingIOError, ssl.SSLWantReadError):
            buffered = b""
        return sock, buffered, bool(self.response.chunked), self.response.length

    def reattach(self, *, complete: bool) -> None:
        """The reader is done: if it read the body to its end, the connection may serve the
        next request (`close` puts it back in the pool)."""
        if complete and not self.complete:
            self.response.close()
            self.complete = True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.complete and not self.response.will_close:
            self.transport._release(self.origin, self.conn)
        else:  # the response holds the socket too when the server said `Connection: close`
            self.response.close()
            self.conn.close()
