"""Serve the API with uvicorn (`cortex api --host --port`)."""

from __future__ import annotations

from cortex_worker.settings import Settings


def run(host: str = "127.0.0.1", port: int = 8000, settings: Settings | None = None, *,
        log_level: str = "info", allow_no_auth: bool = False) -> None:
    """Serve `create_app(settings)` until interrupted; open event streams get 5 s to end.

    Without API keys a non-loopback `host` is refused (`AuthConfigError`) unless
    `allow_no_auth` or the setting `allow_no_auth` says otherwise."""
    import logging

    import uvicorn

    from cortex_api.app import create_app
    from cortex_api.auth import KeyRing, RedactQueryKey, check_binding
    from cortex_worker.settings import get_settings

    settings = settings or get_settings()
    check_binding(host, KeyRing.from_settings(settings), allow_no_auth or settings.allow_no_auth)
    logging.getLogger("uvicorn.access").addFilter(RedactQueryKey())  # `?api_key=` of streams
    uvicorn.run(create_app(settings), host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=5)
