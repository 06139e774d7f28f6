"""Process-wide handles: settings, the state store and the manifest registry."""

from __future__ import annotations

from functools import lru_cache

from cortex_worker.jobs.ends import JobEnds
from cortex_worker.manifests.loader import (
    ManifestError,
    Registry,
    UnknownModelError,
    load_registry,
)
from cortex_worker.services.mcp.listing import shared_listing
from cortex_worker.settings import get_settings
from cortex_worker.store.connect import subscriber_client
from cortex_worker.store.state import Store


@lru_cache(maxsize=1)
def get_store() -> Store:
    """The process's `Store` (one Redis connection pool)."""
    settings = get_settings()
    return Store.from_url(settings.redis_url, replica_acks=settings.redis_replica_acks,
                          replica_wait_ms=settings.redis_replica_wait_ms)


@lru_cache(maxsize=1)
def get_registry() -> Registry:
    """Manifests from `CORTEX_MANIFESTS`, validated once per process (with the `kind: Model`
    that `CORTEX_DOCUMENT_MODEL` names, if it names one). MCP servers' tools are listed once
    for the cluster, shared through Redis (`services.mcp.listing`), unless
    `CORTEX_MCP_LISTING_TTL_S` is 0."""
    settings = get_settings()
    if settings.mcp_listing_ttl_s > 0:
        shared = shared_listing(settings.redis_url, settings.mcp_listing_ttl_s)
        try:
            registry = load_registry(settings.manifests, settings.tool_modules, shared)
        finally:
            shared.redis.close()
    else:
        registry = load_registry(settings.manifests, settings.tool_modules)
    if isinstance(settings.document_model, str):  # a name: it must be a Model of these
        try:
            registry.model(settings.document_model)
        except UnknownModelError as exc:
            raise ManifestError(f"CORTEX_DOCUMENT_MODEL (document_model): {exc}") from None
    return registry


@lru_cache(maxsize=1)
def get_job_ends() -> JobEnds:
    """The process's listener for job ends (one pub/sub connection of its own client,
    started on first use)."""
    return JobEnds(subscriber_client(get_settings().redis_url))


def reset() -> None:
    """Drop the handles, so the next use reads the environment again (tests that point this
    process at another Redis or manifests); the job-end listener is stopped first."""
    if get_job_ends.cache_info().currsize:
        get_job_ends().close()
    for cached in (get_job_ends, get_registry, get_store, get_settings):
        cached.cache_clear()
