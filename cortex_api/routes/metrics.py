"""`GET /metrics`: Prometheus text format, read from Redis at scrape time (cortex_worker.observability.metrics)."""

from __future__ import annotations

import redis
from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from redis.backoff import NoBackoff
from redis.retry import Retry

from cortex_api.deps import SettingsDep, StoreDep
from cortex_worker.observability.metrics import CortexCollector
from cortex_worker.settings import Settings
from cortex_worker.store.connect import is_redis_url, sync_client
from cortex_worker.store.state import POOL_WAIT_S, Store

router = APIRouter(tags=["health"])


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}},
                             "description": "Prometheus text format"}})
def metrics(request: Request, store: StoreDep, settings: SettingsDep) -> Response:
    """Jobs and actions ended, dispatch latency and duration histograms, jobs by status and
    queue lengths (see docs/runtime.md#metrics)."""
    registry = getattr(request.app.state, "metrics_registry", None)
    if registry is None:
        registry = request.app.state.metrics_registry = _registry(store, settings)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _registry(store: Store, settings: Settings) -> CollectorRegistry:
    broker: redis.Redis | None = None
    if settings.broker == settings.redis_url:
        broker = store.redis
    elif is_redis_url(settings.broker):  # a Redis of its own (plain or Sentinel)
        broker = sync_client(settings.broker, retry=Retry(NoBackoff(), 1), max_connections=4,
                             pool_timeout=POOL_WAIT_S)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CortexCollector(store.redis, broker))
    return registry
