"""The `http_get` built-in: GET on loopback or allow-listed hosts only.

A host is allowed when it is in `settings.http_allow_hosts` (exact name, or `.example.com`
/ `*.example.com` for a domain and its subdomains), or when it is a loopback host
(`localhost`, 127.0.0.0/8, ::1) that also resolves to loopback addresses only. Everything
else is refused before any connection is made. Redirects are followed only on the same
host (each hop is checked again); a redirect to another host is an error. Every request
carries the action's `Idempotency-Key` (the same on every attempt), unless the caller's
headers set one.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urljoin

import httpx

from cortex_worker.tools.errors import ToolError, ToolTimeout

MAX_REDIRECTS = 5
DEFAULT_MAX_BYTES = 256 * 1024
KEPT_HEADERS = (
    "content-type",
    "content-length",
    "content-encoding",
    "last-modified",
    "etag",
    "cache-control",
    "location",
)


def allow_listed(host: str, allow_hosts: Iterable[str]) -> bool:
    host = host.lower().rstrip(".")
    for entry in allow_hosts:
        entry = entry.lower().strip().rstrip(".")
        if entry.startswith("*."):
            entry = entry[1:]
        if entry.startswith("."):
            if host == entry[1:] or host.endswith(entry):
                return True
        elif host == entry:
            return True
    return False


def _is_loopback_name(host: str) -> bool:
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_host(url: httpx.URL, allow_hosts: Iterable[str]) -> None:
    """Raise ToolError unless `url` may be fetched; resolves loopback names to verify them."""
    if url.scheme not in ("http", "https"):
        raise ToolError(f"only http and https URLs are allowed, got {url.scheme or 'no'} scheme")
    host = url.host
    if not host:
        raise ToolError(f"URL {str(url)!r} has no host")
    if allow_listed(host, allow_hosts):
        return
    if not _is_loopback_name(host):
        raise ToolError(
            f"host {host!r} is not allowed: http_get reaches loopback hosts and the hosts in "
            "CORTEX_HTTP_ALLOW_HOSTS only"
        )
    try:
        infos = socket.getaddrinfo(host, url.port or 80, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ToolError(f"cannot resolve host {host!r}: {exc}") from None
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if not address.is_loopback:
            raise ToolError(f"host {host!r} resolves to {address}, which is not a loopback address")


def http_get(
    url: str,
    *,
    allow_hosts: Iterable[str],
    timeout: float,
    headers: Mapping[str, str] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    idempotency_key: str | None = None,
) -> dict[str, Any]:
    """{"status", "url", "headers" (a subset), "text" (at most max_bytes), "truncated"}.

    `idempotency_key` is sent as `Idempotency-Key` unless `headers` has one (in any case)."""
    allow = list(allow_hosts)
    headers = dict(headers or {})
    if idempotency_key is not None and not any(k.lower() == "idempotency-key" for k in headers):
        headers["Idempotency-Key"] = idempotency_key
    try:
        current = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise ToolError(f"invalid URL {url!r}: {exc}") from None
    deadline = time.monotonic() + timeout
    with httpx.Client(trust_env=False, follow_redirects=False, timeout=timeout) as client:
        for _ in range(MAX_REDIRECTS + 1):
            check_host(current, allow)
            response = _fetch(client, current, headers, max_bytes, deadline)
            location = response["headers"].get("location")
            if not (300 <= response["status"] < 400 and location):
                return response
            target = httpx.URL(urljoin(str(current), location))
            if (target.host, target.port, target.scheme) != (
                current.host,
                current.port,
                current.scheme,
            ):
                raise ToolError(
                    f"{current} redirects to {target}, another host (or port or scheme); "
                    "fetch that URL directly if it is allowed"
                )
            current = target
    raise ToolError(f"too many redirects (more than {MAX_REDIRECTS}) from {url}")


def _fetch(
    client: httpx.Client,
    url: httpx.URL,
    headers: Mapping[str, str],
    max_bytes: int,
    deadline: float,
) -> dict[str, Any]:
    body = bytearray()
    truncated = False
    try:
        with client.stream("GET", url, headers=dict(headers)) as response:
            for chunk in response.iter_bytes():
                if time.monotonic() > deadline:
                    raise ToolTimeout(f"GET {url} timed out while reading the body")
                room = max_bytes - len(body)
                if len(chunk) > room:
                    body += chunk[:room]
                    truncated = True
                    break
                body += chunk
            encoding = response.encoding or "utf-8"
            kept = {k.lower(): v for k, v in response.headers.items() if k.lower() in KEPT_HEADERS}
            status = response.status_code
    except httpx.TimeoutException as exc:
        raise ToolTimeout(f"GET {url} timed out: {exc}") from None
    except httpx.HTTPError as exc:
        raise ToolError(f"GET {url} failed: {exc}") from None
    try:
        text = body.decode(encoding, errors="replace")
    except LookupError:
        text = body.decode("utf-8", errors="replace")
    return {
        "status": status,
        "url": str(url),
        "headers": kept,
        "text": text,
        "truncated": truncated,
    }
