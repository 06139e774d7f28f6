"""A plain Celery app for `bench/dispatch.py`: the baseline that Cortex dispatch is compared to.

It is Cortex's own Celery configuration (`cortex_worker.app.create_app`: JSON, late acks,
prefetch 1, task events, the same broker) plus one queue, `raw`, and one no-op task. The task
does no Cortex bookkeeping. It records when its body started and ended with one RPUSH, so the
benchmark can read the times.

Worker: `celery -A bench.rawapp worker -Q raw` with `CORTEX_REDIS_URL` set.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis
from celery import Celery
from kombu import Exchange, Queue

from cortex_worker.app import create_app
from cortex_worker.settings import Settings

RAW_QUEUE = "raw"
NOOP_TASK = "bench.raw.noop"

_client: redis.Redis | None = None


def _redis(url: str) -> redis.Redis:
    global _client
    if _client is None:  # one per pool process (created after the fork)
        _client = redis.Redis.from_url(url)
    return _client


def make_app(settings: Settings | None = None) -> Celery:
    """Cortex's Celery app for `settings` plus the `raw` queue and the no-op task."""
    app = create_app(settings)
    app.conf.task_queues = [*app.conf.task_queues,
                            Queue(RAW_QUEUE, Exchange(RAW_QUEUE, type="direct"),
                                  routing_key=RAW_QUEUE)]

    @app.task(name=NOOP_TASK, ignore_result=True)
    def noop(key: str, sent: float) -> None:
        """Record [sent, body start, body end] on the list `key`."""
        started = time.time()
        _redis(app.conf.broker_url).rpush(key, json.dumps([sent, started, time.time()]))

    return app


def send_noop(app: Celery, key: str, producer: Any = None) -> None:
    """Send one no-op task to the `raw` queue; the send time travels as its argument. No
    result is asked for, as Cortex asks none for its actions (a send by name would otherwise
    SUBSCRIBE to the task's result channel first)."""
    app.send_task(NOOP_TASK, args=[key, time.time()], queue=RAW_QUEUE, producer=producer,
                  ignore_result=True)


app = make_app()
