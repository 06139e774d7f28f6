"""A tiny user-defined relic for the tests: an HTTP server on 127.0.0.1 (standard library only).

Run as `python echo_relic.py --port N` (or with `PORT` in the environment). Every answer
carries the server's `pid`, so tests can tell a reused instance from a restarted one.

    GET  /health        {"ok": true, "pid": ...}; HTTP 503 after /sick
    POST /echo          {"pid", "calls", "echo": <the JSON body>}
    GET  /items/{id}    {"pid", "id", "query": {<query parameters>}}
    DELETE /items/{id}  {"pid", "deleted": id}
    POST /fail          HTTP 400 {"error": "asked to fail: <message>"}
    POST /slow          sleeps `seconds`, then {"pid", "slept"}
    POST /sick          from now on /health answers 503
    POST /crash         stops listening, answers {"pid", "crashing": true}, then exits
                        (code 3)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

STATE = {"calls": 0, "sick": False}
LOCK = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    server_version = "echo-relic/1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet, but keep a trace
        sys.stderr.write(f"echo-relic {os.getpid()}: {format % args}\n")

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _json(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        return json.loads(raw) if raw else {}

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/health":
            if STATE["sick"]:
                self._send(503, {"ok": False, "pid": os.getpid()})
            else:
                self._send(200, {"ok": True, "pid": os.getpid()})
        elif url.path.startswith("/items/"):
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            self._send(200, {"pid": os.getpid(), "id": unquote(url.path[7:]), "query": query})
        else:
            self._send(404, {"error": f"no such path: {url.path}"})

    def do_DELETE(self) -> None:
        url = urlsplit(self.path)
        if url.path.startswith("/items/"):
            self._send(200, {"pid": os.getpid(), "deleted": unquote(url.path[7:])})
        else:
            self._send(404, {"error": f"no such path: {url.path}"})

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        body = self._json()
        if path == "/echo":
            with LOCK:
                STATE["calls"] += 1
                calls = STATE["calls"]
            self._send(200, {"pid": os.getpid(), "calls": calls, "echo": body})
        elif path == "/fail":
            self._send(400, {"error": f"asked to fail: {body.get('message', '')}"})
        elif path == "/slow":
            time.sleep(float(body.get("seconds", 1)))
            self._send(200, {"pid": os.getpid(), "slept": body.get("seconds", 1)})
        elif path == "/sick":
            STATE["sick"] = True
            self._send(200, {"pid": os.getpid(), "sick": True})
        elif path == "/crash":
            self.server.socket.close()  # refuse new connections from now on, then answer
            self._send(200, {"pid": os.getpid(), "crashing": True})
            os._exit(3)
        else:
            self._send(404, {"error": f"no such path: {path}"})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT") or 0))
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    print(f"echo-relic {os.getpid()} listening on port {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
