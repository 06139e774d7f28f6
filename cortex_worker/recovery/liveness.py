"""Which worker processes are alive: each beats in Redis; a holder that stopped is dead.

Every worker process (each prefork child, each threaded pool's process) runs one `Heartbeat`
thread. It sets `cx:alive:<host:pid>` every `heartbeat_s` with a `liveness_ttl_s` expiry, so
a process that died, on any host, is known to be dead within `liveness_ttl_s`. Leases of
actions and turns name their holder; `is_dead` is how a lease is judged. A process trusts
the heartbeats only once its own have reached Redis for a whole `liveness_ttl_s` (after a
Redis restart, live processes need that long to beat again).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from cortex_worker.recovery.owners import CHILD_OWNER, dead_here, owner
from cortex_worker.store.state import Store

log = logging.getLogger(__name__)


class Heartbeat:
    """This process's heartbeat thread; `watch` runs after each beat (the fencing check of the
    attempts this process runs: right after a pause too), then `tick` once the heartbeats are
    trusted (the reconciler's turn)."""

    def __init__(self, store: Store, every_s: float, ttl_s: float,
                 tick: Callable[[], None] | None = None,
                 watch: Callable[[], object] | None = None) -> None:
        self.store, self.every_s, self.ttl_s, self.tick = store, every_s, ttl_s, tick
        self.watch = watch
        self.me = owner()
        self._beating_since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cortex-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.beat()  # before the first task: a lease is never held by an unknown process
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def beat(self) -> None:
        try:
            self.store.beat(self.me, self.ttl_s)
        except RedisError:
            self._beating_since = None  # heartbeats in Redis cannot be trusted for a while
            return
        if self._beating_since is None:
            self._beating_since = time.monotonic()

    @property
    def trusted(self) -> bool:
        """Our own beats reached Redis for a whole TTL: the others' have had time to."""
        since = self._beating_since
        return since is not None and time.monotonic() - since >= self.ttl_s

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.beat()
            if self.watch is not None:
                _guarded(self.watch, "fencing check")
            if self.tick is not None and self.trusted:
                _guarded(self.tick, "reconciler pass")


def _guarded(step: Callable[[], object], what: str) -> None:
    """Run one of the heartbeat's steps: an error is logged, never let out (it would stop the
    heartbeat, and the process would look dead)."""
    try:
        step()
    except RedisError as exc:
        log.warning("%s stopped: Redis: %s", what, exc)
    except Exception:
        log.exception("%s failed", what)


def dead(store: Store, holders: set[str]) -> set[str]:
    """Those of `holders` known to be dead: gone from this host, or no heartbeat in Redis.
    A child job holding a lease is not a process and is never dead."""
    holders = {h for h in holders if not h.startswith(CHILD_OWNER)}
    gone = {h for h in holders if dead_here(h)}
    return gone | (holders - gone - store.alive(holders - gone))


def is_dead(store: Store, holder: str) -> bool:
    return bool(holder) and holder in dead(store, {holder})
