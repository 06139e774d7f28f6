"""The Celery app: one queue per pool, JSON only, late acks, nothing lost when a worker dies."""

from __future__ import annotations

from celery import Celery
from kombu import Exchange, Queue

from cortex_worker.pools import KOMBU_PRIORITY_SEP, NAMES, PRIORITIES, lanes
from cortex_worker.settings import Settings, get_settings
from cortex_worker.store.connect import (
    celery_backend_config,
    celery_backend_socket_config,
    celery_broker_config,
    celery_socket_options,
)
from cortex_worker.store.state import MAX_CONNECTIONS
from cortex_worker.worker import kombu_fixes as broker


def restore_lock_expiry(visibility_timeout_s: int) -> int:
    """Seconds kombu's restore lock lives: the visibility timeout, within 5..60 s."""
    return max(5, min(60, visibility_timeout_s))


def create_app(settings: Settings | None = None) -> Celery:
    """Build the Celery app for `settings` (the environment's by default)."""
    settings = settings or get_settings()
    broker.install()
    # A Sentinel URL becomes kombu's and Celery's `sentinel://` URLs plus `master_name` (and
    # the sentinels' options) in the transport options; any other URL is used as it is.
    broker_config, backend_config = celery_broker_config(settings.broker), celery_backend_config(
        settings.redis_url)
    app = Celery("cortex", broker=broker_config["broker_url"],
                 backend=backend_config["result_backend"], include=["cortex_worker.tasks"],
                 events="cortex_worker.observability.task_events:Events")
    app.conf.update(
        task_queues=[Queue(lane, Exchange(pool, type="direct"), routing_key=lane)
                     for pool in NAMES for lane in lanes(pool)],
        task_default_queue="tool",
        task_default_exchange="tool",
        task_default_routing_key="tool",
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=1,
        worker_send_task_events=True,
        task_send_sent_event=True,
        task_track_started=False,
        result_expires=3600,
        # The result backend's pool, as the store's: redis-py 6+ raises past 100 connections.
        redis_max_connections=MAX_CONNECTIONS,
        broker_connection_retry_on_startup=True,
        # Sending a task (a ready action, a canvas's next step, a turn) rides out a broker
        # restart of up to ~30 s; Celery's default gives up after 0.6 s and the step is lost.
        task_publish_retry_policy={"max_retries": 40, "interval_start": 0,
                                   "interval_step": 0.25, "interval_max": 1.0},
        # A task unacknowledged this long is delivered again: longer than any action may run.
        # kombu looks for such tasks every interval x throttle seconds (10 x 10 by default):
        # look every min(10, timeout / 2) s, so a short timeout really is short. The look takes
        # a lock that outlives a worker killed while holding it (or a Redis restart that lost
        # its release) by its expiry, 300 s by default: keep it short. Two workers restoring at
        # once deliver a task twice, which the claim makes harmless.
        broker_transport_options={
            "visibility_timeout": settings.visibility_timeout_s,
            "unacked_restore_interval": max(1, min(10, settings.visibility_timeout_s // 2)),
            "unacked_restore_throttle": 1,
            "unacked_mutex_expire": restore_lock_expiry(settings.visibility_timeout_s),
            "priority_steps": list(range(PRIORITIES)),  # a job's priority: its 0 first
            "sep": KOMBU_PRIORITY_SEP,
            # Bounded reads, TCP keepalive and 5 s health checks: a worker whose broker froze
            # (its BRPOP never answered) reconnects, through the sentinels, within seconds.
            **celery_socket_options(settings.broker),
            **broker_config["broker_transport_options"],
        },
        result_backend_transport_options={"visibility_timeout": settings.visibility_timeout_s,
                                          **backend_config["result_backend_transport_options"]},
        **celery_backend_socket_config(settings.redis_url),
        worker_hijack_root_logger=False,
        worker_cancel_long_running_tasks_on_connection_loss=False,
    )
    return app


app = create_app()
