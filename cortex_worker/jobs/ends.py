"""Job ends and drains pushed to this process: a streaming turn stops the moment its job is
cancelled, and a turn waiting in place takes the next one the moment its job drains.

The `close` script publishes the id of every job that ends on `ENDED_CHANNEL`; `job_drained`
publishes the id of a job that drained on the channel of the process whose turn waits for it
(`wake_channel`). One thread per process listens to both and sets the events of each job a
turn here is watching; the turn tests them at every piece of the model's stream (no Redis call
per token). Pub/sub is fire-and-forget: while the listener is reconnecting a message can be
missed, so turns still look at the job's status now and then (`jobs.turns.reading.STATUS_CHECK_S`),
and a waiting turn asks whether the drain came when it stops waiting (`Store.unwait`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import redis

from cortex_worker.recovery.owners import owner
from cortex_worker.store.connect import Silence
from cortex_worker.store.keys import ENDED_CHANNEL, wake_channel

log = logging.getLogger(__name__)

SUBSCRIBE_WAIT_S = 2.0  # how long the first watch waits for the subscription to be live
RECONNECT_S = 0.5
POLL_S = 1.0  # the listener looks at `close` this often


@dataclass(frozen=True)
class Watch:
    """What was pushed about one watched job."""

    ended: threading.Event = field(default_factory=threading.Event)
    #: set when the job's drain is handed to this process, or when it ended: either way a turn
    #: waiting in place for it stops waiting
    drained: threading.Event = field(default_factory=threading.Event)


class JobEnds:
    """Which watched jobs have ended or drained, as told by Redis pub/sub."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._watches: dict[str, list[Watch]] = {}
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def watch(self, job_id: str) -> Iterator[Watch]:
        """The events of `job_id`'s end and drain, set for the duration of the block."""
        self._start()
        watch = Watch()
        with self._lock:
            self._watches.setdefault(job_id, []).append(watch)
        try:
            yield watch
        finally:
            with self._lock:
                watches = self._watches.get(job_id, [])
                if watch in watches:
                    watches.remove(watch)
                if not watches:
                    self._watches.pop(job_id, None)

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
        """Stop listening, within POLL_S (a process that drops its runtime: the tests), and
        close the client (its own: `connect.subscriber_client`)."""
        self._closed.set()
        thread = self._thread
        if thread is not None:
            thread.join(POLL_S + RECONNECT_S + 1.0)
        self._client.close()

    def _listen(self) -> None:
        while not self._closed.is_set():
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                wake = wake_channel(owner())
                pubsub.subscribe(ENDED_CHANNEL, wake)
                self._subscribed.set()
                silence = Silence()  # a frozen master: connect again, through the sentinels
                while not self._closed.is_set():
                    message = pubsub.get_message(timeout=POLL_S)
                    if message is not None:  # a message, or the PONG asked for
                        silence.heard_from()
                        if message.get("type") == "message":
                            self._pushed(str(message["data"]),
                                         ended=str(message["channel"]) != wake)
                    elif why := silence.lost():
                        raise redis.ConnectionError(why)
                    elif silence.due():
                        pubsub.ping()
            except redis.RedisError as exc:
                log.warning("job-end listener lost Redis (%s); reconnecting", exc)
            finally:
                self._subscribed.clear()
                pubsub.close()
            self._closed.wait(RECONNECT_S)

    def _pushed(self, job_id: str, *, ended: bool) -> None:
        with self._lock:
            watches = list(self._watches.get(job_id, ()))
        for watch in watches:
            if ended:
                watch.ended.set()
            watch.drained.set()
