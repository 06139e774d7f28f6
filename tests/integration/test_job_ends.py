"""The job-end listener (`cortex_worker/jobs/ends.py`) on a real redis-server that freezes.

A master frozen with its connections open (SIGSTOP: a paused VM, a partition; its kernel still
acknowledges what is sent to it) fails no command, so a subscribed connection would hear
nothing until the node woke, long after Sentinel had promoted another. The listener asks for a
PONG when it has heard nothing for `PING_S`, and without one within the read timeout connects
again. Asserted on what the listener does (its log, and the ends it tells watchers of), never
on how long it took."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from cortex_worker.jobs.ends import JobEnds, Watch
from cortex_worker.store.connect import PUBSUB_PING_S, READ_TIMEOUT_S, subscriber_client
from cortex_worker.store.keys import ENDED_CHANNEL
from tests import harness

LOST = "job-end listener lost Redis"


def told(publisher: redis.Redis, job_id: str, watch: Watch) -> None:
    """Publish the job's end until the watch has it: a count of subscribers can include a
    connection the listener has left and the woken node has not closed yet."""
    for _ in range(600):  # up to 120 s, a backstop
        publisher.publish(ENDED_CHANNEL, job_id)
        if watch.ended.wait(0.2):
            return
    raise AssertionError(f"the end of {job_id} never reached the listener")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[harness.RedisServer]:
    with harness.RedisServer(log_dir=tmp_path, data_dir=tmp_path / "redis") as running:
        yield running


def test_a_frozen_node_is_left_and_the_listener_hears_ends_again(
        server: harness.RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="cortex_worker.jobs.ends")
    ends = JobEnds(subscriber_client(server.url))  # as the process's (handles.get_job_ends)
    publisher = server.client(decode_responses=True)
    process = server.process
    assert process is not None
    try:
        with ends.watch("before") as watch:
            told(publisher, "before", watch)
            # quiet for longer than PUBSUB_PING_S: its PING is answered, nothing is "lost"
            quiet = threading.Event()
            assert not quiet.wait(PUBSUB_PING_S + READ_TIMEOUT_S + 2)
            assert not [r for r in caplog.records if LOST in r.getMessage()], caplog.text

        process.kill(signal.SIGSTOP)
        try:
            harness.wait_until(lambda: any(LOST in r.getMessage() for r in caplog.records),
                               timeout=120, interval=0.2,
                               message="the listener never left the frozen node")
            assert "no answer to a PING" in next(r.getMessage() for r in caplog.records
                                                 if LOST in r.getMessage())
        finally:
            process.kill(signal.SIGCONT)

        with ends.watch("after") as watch:  # subscribed again on the woken node
            told(publisher, "after", watch)
    finally:
        ends.close()
        publisher.close()
