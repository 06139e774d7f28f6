"""Job ends pushed to this process, so a streaming turn stops the moment its job is cancelled.

The `close` script publishes the id of every job that ends on `ENDED_CHANNEL`. One thread per
process listens and sets the `threading.Event` of each job a turn here is watching; the turn
tests that event at every piece of the model's stream (no Redis call per token). Pub/sub is
fire-and-forget: while the listener is reconnecting a message can be missed, so turns still
look at the job's status now and then (`coordinator.STATUS_CHECK_S`) as a backstop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from cortex_worker.keys import ENDED_CHANNEL

log = logging.getLogger(__name__)

SUBSCRIBE_WAIT_S = 2.0  # how long the first watch waits for the subscription to be live
RECONNECT_S = 0.5
POLL_S = 1.0  # the listener looks at `close` this often


class JobEnds:
    """Which watched jobs have ended, as told by Redis pub/sub."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._events: dict[str, list[threading.Event]] = {}
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def watch(self, job_id: str) -> Iterator[threading.Event]:
        """An event that is set when `job_id` ends, for the duration of the block."""
        self._start()
        event = threading.Event()
        with self._lock:
            self._events.setdefault(job_id, []).append(event)
        try:
            yield event
        finally:
            with self._lock:
                events = self._events.get(job_id, [])
                if event in events:
                    events.remove(event)
                if not events:
                    self._events.pop(job_id, None)

    def _start(self) -> None:
        """Start the listener if it is not running, and then let it subscribe first (a turn
        during a later reconnect does not wait: the status check covers the gap)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(target=self._listen, name="cortex-job-ends",
                                            daemon=True)
            self._thread.start()
        self._subscribed.wait(SUBSCRIBE_WAIT_S)

    def close(self) -> None:
        """Stop listening, within POLL_S (a process that drops its runtime: the tests)."""
        self._closed.set()
        thread = self._thread
        if thread is not None:
            thread.join(POLL_S + RECONNECT_S + 1.0)

    def _listen(self) -> None:
        while not self._closed.is_set():
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(ENDED_CHANNEL)
                self._subscribed.set()
                while not self._closed.is_set():
                    message = pubsub.get_message(timeout=POLL_S)
                    if message is not None and message.get("type") == "message":
                        self._ended(str(message["data"]))
            except redis.RedisError as exc:
                log.warning("job-end listener lost Redis (%s); reconnecting", exc)
            finally:
                self._subscribed.clear()
                pubsub.close()
            self._closed.wait(RECONNECT_S)

    def _ended(self, job_id: str) -> None:
        with self._lock:
            events = list(self._events.get(job_id, ()))
        for event in events:
            event.set()
