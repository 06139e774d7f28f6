"""The store's Redis connections under many threads: an agent worker runs 200 turns at once
by default, besides its heartbeat, reconciler and listeners."""

from __future__ import annotations

import threading

from cortex_worker.store.state import Store
from tests import harness

THREADS = 160


def test_more_threads_than_redis_py_default_pool_share_one_store(
        redis_server: harness.RedisServer) -> None:
    """redis-py 6+ caps a plain pool at 100 connections and then raises MaxConnectionsError:
    a turn that hit it failed mid-stream (seen at 100 agent streams). The store waits."""
    store = Store.from_url(redis_server.url)
    start = threading.Barrier(THREADS)
    errors: list[BaseException] = []

    def hold() -> None:
        try:
            start.wait()
            store.redis.blpop([f"test:pool:{threading.get_ident()}"], timeout=1)
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=hold) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
