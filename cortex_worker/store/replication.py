"""Writes a failover cannot take back: each waits until a replica has it (`WAIT`).

Redis replicates asynchronously: a write the master acknowledged and had not yet sent on is
gone when Sentinel promotes a replica. So every write of job state (each Lua script of the
store, each batch of events) is followed, on the same connection and in the same round trip,
by `WAIT <acks> <timeout>`, and its writer goes on only once `acks` replicas have it: a
result, an attempt count, a job's end, a registration, an event. `acks` is the configured
number (`redis_replica_acks`) or the replicas connected now if fewer (none: nothing waits, as
on a lone Redis). A replica that does not answer within the timeout (`redis_replica_wait_ms`)
lets the write go on, counted as unreplicated (metric `cortex_unreplicated_writes`) and logged.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import redis

from cortex_worker.store.keys import METRIC_COUNTERS

log = logging.getLogger(__name__)

LOOK_EVERY_S = 5.0
"""How often the master is asked how many replicas it has (INFO replication)."""


class Replication:
    """How many replicas this process's writes wait for, and for how long."""

    def __init__(self, client: redis.Redis, acks: int, wait_ms: int) -> None:
        self.client, self.wanted, self.wait_ms = client, acks, wait_ms
        self._connected = 0
        self._looked_at = float("-inf")
        self._lock = threading.Lock()

    def acks(self) -> int:
        """The replicas the next write waits for: the configured number, or those connected
        if fewer (looked at every LOOK_EVERY_S); 0 when writes need not wait."""
        if self.wanted <= 0:
            return 0
        now = time.monotonic()
        if now - self._looked_at >= LOOK_EVERY_S:
            with self._lock:
                if now - self._looked_at >= LOOK_EVERY_S:
                    self._look()
                    self._looked_at = now
        return min(self.wanted, self._connected)

    def _look(self) -> None:
        try:
            info = self.client.info("replication")
        except redis.RedisError:
            return  # the write itself will meet the error
        self._connected = int(info.get("connected_slaves", 0)) if info.get("role") == "master" else 0

    def acked(self, got: int, wanted: int, what: str) -> None:
        """A write's WAIT answered `got` of `wanted`: fewer is counted and logged, and the
        number of replicas is looked at again before the next write."""
        if got >= wanted:
            return
        self._looked_at = float("-inf")
        log.warning("%s: %d of %d replica(s) acknowledged it within %d ms: a failover now "
                    "could lose it", what, got, wanted, self.wait_ms)
        with contextlib.suppress(redis.RedisError):
            self.client.hincrby(METRIC_COUNTERS, f"unreplicated_writes|{what}", 1)
