"""Serve the API with uvicorn (`cortex api --host --port`)."""

from __future__ import annotations

import logging
import resource
import socket

from cortex_worker.settings import Settings

log = logging.getLogger(__name__)


def raise_open_files_limit() -> int:
    """Lift this process's soft limit of open files to its hard limit (every event stream
    holds a socket; 1024, a common default, caps the clients below that); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open files limit from %d: %s", soft, exc)
            return soft
    return hard


def run(host: str = "127.0.0.1", port: int = 8000, settings: Settings | None = None, *,
        log_level: str = "info", allow_no_auth: bool = False, fd: int | None = None) -> None:
    """Serve `create_app(settings)` until interrupted; open event streams get 5 s to end.
    `fd`: a listening socket its parent bound (`host` and `port` are then the socket's).

    Without API keys a non-loopback `host` is refused (`AuthConfigError`) unless
    `allow_no_auth` or the setting `allow_no_auth` says otherwise."""
    import uvicorn

    from cortex_api.app import create_app
    from cortex_api.auth import KeyRing, RedactQueryKey, check_binding
    from cortex_worker.settings import get_settings

    settings = settings or get_settings()
    if fd is not None:
        with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as bound:  # a duplicate
            host, port = bound.getsockname()[:2]
    check_binding(host, KeyRing.from_settings(settings), allow_no_auth or settings.allow_no_auth)
    raise_open_files_limit()
    logging.getLogger("uvicorn.access").addFilter(RedactQueryKey())  # `?api_key=` of streams
    uvicorn.run(create_app(settings), host=host, port=port, fd=fd, log_level=log_level,
                timeout_graceful_shutdown=5)
