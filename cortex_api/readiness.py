"""`/readyz`: Redis answers and every required pool has a worker (cached for a moment)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from cortex_api.models import Readiness
from cortex_worker.app import create_app
from cortex_worker.pools import NAMES
from cortex_worker.settings import Settings
from cortex_worker.store.connect import describe

DEFAULT_REQUIRED = ("agent", "tool")

Inspector = Callable[[], dict[str, int]]


def required_pools(settings: Settings) -> list[str]:
    """`settings.required_pools`, or agent and tool when there is no such setting."""
    value = getattr(settings, "required_pools", None)
    return list(DEFAULT_REQUIRED if value is None else value)


def count_workers(replies: Mapping[str, Any] | None, pools: Iterable[str] = NAMES) -> dict[str, int]:
    """Workers per pool from `inspect().active_queues()` replies ({worker: [{name: queue}...]})."""
    counts = dict.fromkeys(pools, 0)
    for queues in (replies or {}).values():
        for name in {q.get("name") for q in queues or () if isinstance(q, Mapping)}:
            if name in counts:
                counts[name] += 1
    return counts


def celery_inspector(settings: Settings, timeout: float) -> Inspector:
    """Ask the Celery workers which queues they consume (blocking: run it in a thread)."""
    app = None

    def inspect() -> dict[str, int]:
        nonlocal app
        if app is None:
            app = create_app(settings)
        try:
            return count_workers(app.control.inspect(timeout=timeout).active_queues())
        except Exception:
            # kombu does not retry a command that timed out: a broker connection left open to
            # a master that froze would fail each probe in turn. The next probe starts afresh.
            app.close()
            app = None
            raise

    return inspect


class ReadinessProbe:
    """Checks Redis and the worker pools; one probe at a time, result kept for `ttl` seconds."""

    def __init__(self, ping: Callable[[], Any], inspector: Inspector, required: Iterable[str],
                 *, timeout: float = 1.0, ttl: float = 2.0) -> None:
        self._ping = ping
        self._inspector = inspector
        self.required = list(required)
        self.timeout = timeout
        self.ttl = ttl
        self._lock = asyncio.Lock()
        self._cached: tuple[float, Readiness] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cortex-readyz")
        self._inflight: Future[dict[str, int]] | None = None

    async def check(self) -> Readiness:
        async with self._lock:
            now = time.monotonic()
            if self._cached is not None and now - self._cached[0] < self.ttl:
                return self._cached[1]
            result = await self._probe()
            self._cached = (time.monotonic(), result)
            return result

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _probe(self) -> Readiness:
        try:
            await asyncio.wait_for(self._ping(), self.timeout)
        except Exception as exc:
            return Readiness(status="not_ready", redis=False, required=self.required,
                             missing=self.required, error=f"redis: {describe(exc)}")
        error = None
        try:
            pools = await self._workers()
        except Exception as exc:
            pools, error = {}, f"workers: {exc or type(exc).__name__}"
        missing = [p for p in self.required if pools.get(p, 0) < 1]
        if missing and error is None:
            error = f"no worker consumes: {', '.join(missing)}"
        return Readiness(status="not_ready" if missing else "ready", redis=True, pools=pools,
                         required=self.required, missing=missing, error=error)

    async def _workers(self) -> dict[str, int]:
        # A probe still running (a stuck broker) is awaited again rather than piled up.
        if self._inflight is None or self._inflight.done():
            self._inflight = self._executor.submit(self._inspector)
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._inflight)),
                                      self.timeout + 2.0)
