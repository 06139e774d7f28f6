"""The model streams' HTTP transport (cortex_worker/llm/http11.py) against a real HTTP/1.1
server on loopback that keeps connections alive, as model servers do: connections are
reused, stale ones replaced, and every failure is the httpx exception the gateway expects."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from cortex_worker.llm import transport
from cortex_worker.llm.http11 import Http11Transport

pytestmark = pytest.mark.unit


class KeepAliveServer:
    """Answers each request by its path; records (path, connection number) of each."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.seen: list[tuple[str, int]] = []
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn, len(self.conns)), daemon=True).start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        with conn, contextlib.suppress(OSError):  # OSError: the test closed the server
            self._requests(conn, number)

    def _requests(self, conn: socket.socket, number: int) -> None:
        buffer = b""
        while True:
            while b"\r\n\r\n" not in buffer:
                data = conn.recv(65536)
                if not data:
                    return
                buffer += data
            head, _, buffer = buffer.partition(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            length = next((int(line.split(":")[1]) for line in lines[1:]
                           if line.lower().startswith("content-length:")), 0)
            while len(buffer) < length:
                buffer += conn.recv(65536)
            buffer = buffer[length:]
            path = lines[0].split()[1]
            self.seen.append((path, number))
            if not self._answer(conn, path):
                return

    @staticmethod
    def _answer(conn: socket.socket, path: str) -> bool:
        """Send the response of `path`; False: the connection ends here."""
        chunked = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n" \
                  b"transfer-encoding: chunked\r\n\r\n"
        if path == "/chunked":
            conn.sendall(chunked + b"".join(b"%x\r\n%s\r\n" % (len(p), p)
                                            for p in (b"data: 1\n\n", b"data: 2\n\n", b"")))
        elif path in ("/length", "/length-then-close"):
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello")
            return path == "/length"
        elif path == "/connection-close":
            conn.sendall(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok")
            return False
        elif path == "/cut-chunked":
            conn.sendall(chunked + b"9\r\ndata: 1\n\n\r\n")
            return False
        elif path == "/short":
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b")
            return False
        elif path == "/slow":
            time.sleep(1.5)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        elif path == "/garbage":
            conn.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            return False
        return True


@pytest.fixture
def server() -> Iterator[KeepAliveServer]:
    s = KeepAliveServer()
    yield s
    s.close()


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(transport=Http11Transport()) as c:
        yield c


def test_a_chunked_stream_arrives_whole_and_its_connection_is_reused(
        server: KeepAliveServer, client: httpx.Client) -> None:
    for _ in range(3):
        with client.stream("POST", f"{server.url}/chunked", json={"a": 1}) as response:
            assert response.status_code == 200
            assert list(response.iter_lines()) == ["data: 1", "", "data: 2", ""]
    assert client.get(f"{server.url}/length").text == "hello"
    assert server.seen == [("/chunked", 1)] * 3 + [("/length", 1)]


def test_a_connection_the_server_closed_while_idle_is_replaced(
        server: KeepAliveServer, client: httpx.Client) -> None:
    assert client.get(f"{server.url}/length-then-close").text == "hello"
    time.sleep(0.1)  # the server has closed it by now
    assert client.get(f"{server.url}/length").text == "hello"
    assert server.seen == [("/length-then-close", 1), ("/length", 2)]


def test_connection_close_and_an_unread_body_are_never_reused(
        server: KeepAliveServer, client: httpx.Client) -> None:
    assert client.get(f"{server.url}/connection-close").text == "ok"
    with client.stream("POST", f"{server.url}/chunked") as response:
        next(response.iter_raw())  # left unread: closed, not pooled
    assert client.get(f"{server.url}/length").text == "hello"
    assert [n for _, n in server.seen] == [1, 2, 3]


@pytest.mark.parametrize("path", ["/cut-chunked", "/short"])
def test_a_body_cut_short_is_a_remote_protocol_error(
        server: KeepAliveServer, client: httpx.Client, path: str) -> None:
    with pytest.raises(httpx.RemoteProtocolError, match="complete message body"):
        client.get(f"{server.url}{path}")


def test_an_answer_that_is_not_http_is_a_remote_protocol_error(
        server: KeepAliveServer, client: httpx.Client) -> None:
    with pytest.raises(httpx.RemoteProtocolError, match="invalid response"):
        client.get(f"{server.url}/garbage")


def test_a_silent_server_is_a_read_timeout(server: KeepAliveServer,
                                           client: httpx.Client) -> None:
    with pytest.raises(httpx.ReadTimeout):
        client.get(f"{server.url}/slow", timeout=httpx.Timeout(5, read=0.3))


def test_nothing_listening_is_a_connect_error(client: httpx.Client) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        with pytest.raises(httpx.ConnectError):
            client.get(f"http://127.0.0.1:{port}/")


def test_other_schemes_are_refused(client: httpx.Client) -> None:
    with pytest.raises(httpx.UnsupportedProtocol):
        client.send(httpx.Request("GET", "ftp://127.0.0.1/x"))


def test_the_shared_client_keeps_httpx_transport_where_a_proxy_is_configured(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY",
                 "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    transport.close_shared_client()
    assert isinstance(transport.shared_client()._transport, Http11Transport)
    transport.close_shared_client()
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    try:
        client = transport.shared_client()
        assert isinstance(client._transport, httpx.HTTPTransport)
        assert any(t is not None for t in client._mounts.values())  # the proxy's
    finally:
        transport.close_shared_client()
