"""The FastAPI application: `create_app(settings)`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import metadata

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

from cortex_api.auth import KeyRing, metrics_guard
from cortex_api.errors import install_handlers
from cortex_api.limits import BodyLimitMiddleware, body_limit
from cortex_api.readiness import ReadinessProbe, celery_inspector, required_pools
from cortex_api.routes import (
    a2a,
    agui,
    health,
    jobs,
    mcp,
    metrics,
    page,
    registry,
    sessions,
    usage,
    validate,
)
from cortex_api.sse import EventHub
from cortex_worker.observability import tracing
from cortex_worker.settings import Settings, get_settings
from cortex_worker.store.state import Store
from cortex_worker.worker import signals


def _version() -> str:
    try:
        return metadata.version("cortex")
    except metadata.PackageNotFoundError:
        return "0.0.0"


def create_app(settings: Settings | None = None) -> FastAPI:
    """The Cortex REST API for `settings` (the environment's by default)."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = Store.from_url(settings.redis_url, replica_acks=settings.redis_replica_acks,
                               replica_wait_ms=settings.redis_replica_wait_ms)  # threadpool'd
        hub = EventHub.from_url(settings.redis_url)
        probe = ReadinessProbe(hub.ping, celery_inspector(settings, timeout=1.0),
                               required_pools(settings))
        app.state.store, app.state.hub, app.state.readiness = store, hub, probe
        tracing.configure("cortex-api")  # a job's start message carries its trace
        signals.connect_messages()
        try:
            async with mcp_endpoint.run():  # /mcp's session manager (routes/mcp.py)
                yield
        finally:
            tracing.flush()
            probe.close()
            await hub.aclose()
            store.redis.close()

    app = FastAPI(title="Cortex", version=_version(), lifespan=lifespan,
                  docs_url=None, redoc_url=None,  # FastAPI's load their scripts from a CDN
                  description="A distributed runtime for LLM agents: submit protocol documents "
                              "as jobs, follow their events, cancel them.")
    _serve_docs(app)
    app.state.settings = settings
    app.state.keyring = KeyRing.from_settings(settings)  # sha256 digests only; see auth.py
    app.add_middleware(BodyLimitMiddleware, max_bytes=body_limit(settings))
    if settings.cors_origins:  # browser frontends (AG-UI) on other origins; off by default
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins,
                           allow_methods=["*"], allow_headers=["*"])
    install_handlers(app)  # every exception handler: errors of the CortexError tree, Redis, ...
    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(validate.router)
    app.include_router(registry.router)
    app.include_router(sessions.router)
    app.include_router(agui.router)  # /v1/agents/{name}/ag-ui: AG-UI runs
    app.include_router(usage.router)
    app.include_router(metrics.router, dependencies=[Depends(metrics_guard)])  # metrics_public
    app.include_router(page.router)
    app.include_router(a2a.router)  # /v1/a2a/{name}: each agent as an A2A server
    mcp_endpoint = mcp.mount(app)  # /mcp: the agents as MCP tools
    return app


DOCS_ASSETS = "/docs/assets"


def _serve_docs(app: FastAPI) -> None:
    """`/docs`: Swagger UI from its files in the `swagger-ui-bundle-v2` package, served here,
    so that the page works offline and behind a firewall."""
    app.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_path), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} API",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png",
            # no badge fetched from the online validator (validator.swagger.io)
            swagger_ui_parameters={"validatorUrl": None})
