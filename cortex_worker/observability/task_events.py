"""Celery's task events (for Flower), published by a background thread of each process.

Celery publishes an event in the thread that caused it: the worker sends `task-received`
before it hands the task to its pool, and a sender sends `task-sent` right after the task.
Each publish is a Redis PUBLISH and a message encoding, about 0.6-1.3 ms of a hop's latency on
a busy machine (docs/performance.md, "Task events off the hop"). Here each event is still
built where it happens (its clock and timestamp are the moment it describes), then queued;
one thread per process publishes the queue in order on its own connection. Nothing Flower
sees changes but when it sees it, a fraction of a millisecond later.

`Events` is the Celery app's `events` class (`Celery(events=...)`, see `app.create_app`).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import weakref
from typing import Any

from celery.app.events import Events as CeleryEvents
from celery.events.dispatcher import EventDispatcher
from kombu import Producer

log = logging.getLogger(__name__)

QUEUE_LIMIT = 10_000  # events waiting to be published; past it new ones are dropped (counted)
CLOSE_WAIT_S = 2.0  # how long closing a dispatcher waits for its queued events to go out
PUBLISH_RETRY = {"max_retries": 3, "interval_start": 0.1, "interval_step": 0.2,
                 "interval_max": 0.5}

_STOP = object()


class BackgroundDispatcher(EventDispatcher):
    """An EventDispatcher whose publishing happens on its own thread (started per process,
    on first use, so a forked child gets its own)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._queue: queue.Queue[Any] = queue.Queue(QUEUE_LIMIT)
        self._thread: threading.Thread | None = None
        self._thread_pid = 0
        self._start_lock = threading.Lock()
        self.dropped = 0  # events not published: the queue was full, or publishing failed
        _open.add(self)

    def _publish(self, event: Any, producer: Any, routing_key: str, retry: bool = False,
                 retry_policy: Any = None, **_: Any) -> None:
        """Queue the prepared event (or a batch of them) for the publishing thread; the
        caller's producer is not used (it may be back in its pool by then)."""
        if producer is None:  # disabled or closed, as in Celery
            return
        self._ensure_thread()
        try:
            self._queue.put_nowait((event, routing_key))
        except queue.Full:
            self.dropped += 1

    def _ensure_thread(self) -> None:
        """Start the publishing thread: on first use, in a forked child, or after it stopped
        (it could not connect to the broker)."""
        thread = self._thread
        if self._thread_pid == os.getpid() and thread is not None and thread.is_alive():
            return
        with self._start_lock:
            thread = self._thread
            if self._thread_pid != os.getpid() or thread is None or not thread.is_alive():
                if self._thread_pid != os.getpid():  # forked: the parent's queue is not ours
                    self._queue = queue.Queue(QUEUE_LIMIT)
                self._thread = threading.Thread(target=self._run, name="celery-events",
                                                daemon=True)
                self._thread_pid = os.getpid()
                self._thread.start()

    def _run(self) -> None:
        connection = self.app.connection_for_write()
        try:
            producer = Producer(connection, exchange=self.exchange, serializer=self.serializer,
                                auto_declare=False)
            while True:
                item = self._queue.get()
                if item is _STOP:
                    return
                event, routing_key = item
                try:
                    producer.publish(event, routing_key=routing_key, exchange=self.exchange.name,
                                     retry=True, retry_policy=PUBLISH_RETRY,
                                     declare=[self.exchange], serializer=self.serializer,
                                     headers=self.headers, delivery_mode=self.delivery_mode)
                except Exception as exc:  # the broker is away: events are best effort
                    self.dropped += 1
                    log.debug("task event %s not published: %s", routing_key, exc)
        finally:
            connection.release()

    def drain(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Publish what is queued (waiting up to `timeout`), then stop the thread."""
        thread = self._thread
        if thread is None or self._thread_pid != os.getpid() or not thread.is_alive():
            return
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            return
        thread.join(timeout)
        self._thread = None

    def close(self) -> None:
        self.drain()
        super().close()


_open: weakref.WeakSet[BackgroundDispatcher] = weakref.WeakSet()


@atexit.register
def drain_all() -> None:
    """The events still queued in this process go out: at a worker process's shutdown (the
    `task-events` step of `cortex_worker.worker.steps`; a prefork child exits without running
    `atexit`), and at exit (a sender's last `task-sent`, ...)."""
    for dispatcher in list(_open):
        dispatcher.drain()


class Events(CeleryEvents):
    """The app's events: Celery's, with the dispatcher above."""

    dispatcher_cls = "cortex_worker.observability.task_events:BackgroundDispatcher"
