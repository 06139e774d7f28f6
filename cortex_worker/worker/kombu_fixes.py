"""Fixes to the Redis transport of kombu, most found by the chaos tests; `install()` applies them.

A worker whose broker connection drops closes its channels, and kombu 5.7 tears their
connection down first. Two paths then reach that connection and end the worker process with
an `AttributeError` ('NoneType' object has no attribute 'hostname' / 'client'):

- the channel hands back the tasks it holds (`QoS.restore_unacked`; about 1 Redis restart
  in 3);
- a task that was running across the connection loss ends and is acknowledged (`QoS.ack`,
  `QoS.reject`) on its old channel: every Redis restart during a task that outlives it (an
  agent turn waiting in place for its actions, a long tool).

Those tasks are still in kombu's unacked set in Redis, and its periodic sweep delivers them
again after the visibility timeout, so both are skipped instead: the worker lives and nothing
is lost. The late duplicate is harmless: Cortex runs an action and a turn once (`claim`,
`resume`).

A worker takes from its pool's lanes in turn, and within a lane by a job's priority: kombu's
`BRPOP` lists every lane's first priority before any lane's next (one tenant's work would go
before every other tenant's); it lists each lane's priorities together instead, the lanes in
the order of its round-robin cycle (`actions/fairness.py`: a priority orders a tenant's own
work).

A worker's `BRPOP` names each of its pool's lanes at each priority (160 keys): building and
packing it took about 0.5 ms of the worker's CPU for every message it took. Each turn of the
cycle's command is now packed once and kept.

One cost is removed too: the channel built a new redis-py client for every command it sent
outside its event loop (each task sent, each task received, each event published), about
0.2 ms of CPU on a hop's path apiece. The channel now keeps one (a client is safe to share
between threads) and builds another only when its connection pool is replaced.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from time import monotonic
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

log = logging.getLogger(__name__)


def _torn_down(qos: Any) -> bool:
    """The channel's broker connection is gone (closed after a connection loss)."""
    return getattr(qos.channel.connection, "client", None) is None


BRPOP_COMMANDS_KEPT = 64
"""Packed `BRPOP` commands a channel keeps: one per turn of its round-robin cycle (a pool's
lanes), more only while its queues change."""


def _brpop_lane_by_lane(self: Any, timeout: float | None = None) -> None:
    """kombu's `Channel._brpop_start` with its keys lane-major: each queue's priority lists
    together, the queues in the order of its round-robin cycle. A pool's command names every
    lane's priority lists (160 keys), so each turn's command is packed once and kept: it was
    rebuilt for every message the worker took."""
    if timeout is None:
        timeout = self.brpop_timeout
    queues = self._queue_cycle.consume(len(self.active_queues))
    if not queues:
        return
    connection = self.client.connection
    self._in_poll = connection
    self._brpop_sent_at = monotonic()
    kept = self.__dict__.setdefault("_cortex_brpop", {})
    key = (tuple(queues), timeout or 0, self.global_keyprefix)
    packed = kept.get(key)
    if packed is None:
        keys = [self._q_for_pri(queue, pri) for queue in queues for pri in self.priority_steps]
        command_args = ["BRPOP", *keys, timeout or 0]
        if self.global_keyprefix:
            command_args = self.client._prefix_args(command_args)
        packer = getattr(connection, "_command_packer", None)
        if packer is None:  # a connection of another kind: packed by itself each time
            connection.send_command(*command_args)
            return
        if len(kept) >= BRPOP_COMMANDS_KEPT:
            kept.clear()
        packed = kept[key] = packer.pack(*command_args)
    connection.send_packed_command(packed)


@cache
def install() -> None:
    """Apply the fixes (once per process: a second call does nothing)."""
    restore_unacked, ack, reject = (kombu_redis.QoS.restore_unacked, kombu_redis.QoS.ack,
                                    kombu_redis.QoS.reject)

    def safe_restore_unacked(self: Any, client: Any = None) -> None:
        if client is None and _torn_down(self):
            log.warning("broker connection already closed: %d unacknowledged task(s) will be "
                        "delivered again after the visibility timeout", len(self._delivered))
            self._delivered.clear()
            return
        restore_unacked(self, client)

    def safe_ack(self: Any, delivery_tag: Any) -> None:
        if _torn_down(self):
            log.warning("broker connection already closed: task %s stays unacknowledged and is "
                        "delivered again after the visibility timeout", delivery_tag)
            virtual.QoS.ack(self, delivery_tag)  # forget it here
            return
        ack(self, delivery_tag)

    def safe_reject(self: Any, delivery_tag: Any, requeue: bool = False) -> None:
        if _torn_down(self):
            log.warning("broker connection already closed: task %s stays unacknowledged and is "
                        "delivered again after the visibility timeout", delivery_tag)
            virtual.QoS.ack(self, delivery_tag)
            return
        reject(self, delivery_tag, requeue)

    @contextmanager
    def shared_client(self: Any, client: Any = None) -> Iterator[Any]:
        if client:
            yield client
            return
        kept = self.__dict__.get("_cortex_client")
        if kept is None or kept.connection_pool is not self.pool:  # a new pool after a loss
            kept = self._cortex_client = self._create_client()
        yield kept

    kombu_redis.QoS.restore_unacked = safe_restore_unacked
    kombu_redis.QoS.ack = safe_ack
    kombu_redis.QoS.reject = safe_reject
    kombu_redis.Channel.conn_or_acquire = shared_client
    kombu_redis.Channel._brpop_start = _brpop_lane_by_lane
