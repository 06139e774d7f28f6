"""The kombu fix of cortex_worker.broker, on a real Redis: a channel that closes after its
connection was torn down keeps the worker alive, and its task is delivered again."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kombu import Connection, Exchange, Queue

from cortex_worker import broker
from tests import harness

pytestmark = pytest.mark.integration

QUEUE = Queue("tool", Exchange("tool", type="direct"), routing_key="tool")


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    server = harness.RedisServer(log_dir=tmp_path, data_dir=tmp_path / "redis")
    server.start()
    try:
        yield server.url
    finally:
        server.close()


def test_a_channel_closing_after_its_connection_keeps_the_task(redis_url: str) -> None:
    broker.install()
    options = {"visibility_timeout": 1, "unacked_restore_throttle": 1}
    conn = Connection(redis_url, transport_options=options)
    with conn.Producer() as producer:
        producer.publish({"task": 1}, exchange=QUEUE.exchange, routing_key="tool",
                         declare=[QUEUE])
    channel = conn.channel()
    message = channel.basic_get("tool", no_ack=False)
    assert message is not None and channel.qos._delivered
    conn.transport.client = None  # torn down first, as kombu 5.7 does on a connection loss
    channel.close()  # raised AttributeError ('NoneType' ... 'hostname') before the fix

    # the task is still in kombu's unacked set: the sweep hands it back after the timeout
    time.sleep(1.2)
    with Connection(redis_url, transport_options=options) as other:
        sweeper = other.channel()
        sweeper.qos.restore_visible(num=10)
        again = sweeper.basic_get("tool", no_ack=True)
        assert again is not None and again.payload == {"task": 1}
