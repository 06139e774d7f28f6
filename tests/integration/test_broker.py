"""The broker on a real Redis: the kombu fix of cortex_worker.worker.kombu_fixes (a channel that closes
after its connection was torn down keeps the worker alive, and its task is delivered again),
and what sending a task asks of Redis."""

from __future__ import annotations

import time

import celery._state
import pytest
import redis
from kombu import Connection, Exchange, Queue

from cortex_worker.actions.dispatch import ACTION_TASK, INVOKE_TASK, TURN_TASK, CeleryBroker
from cortex_worker.app import create_app
from cortex_worker.settings import Settings
from cortex_worker.worker import kombu_fixes as broker

pytestmark = pytest.mark.integration

QUEUE = Queue("tool", Exchange("tool", type="direct"), routing_key="tool")


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


def test_a_task_acknowledged_after_its_connection_closed_keeps_the_worker(
        redis_url: str) -> None:
    """A task running across a connection loss (an agent turn waiting in place, a long tool)
    ends and is acknowledged on its closed channel: that raised AttributeError ('NoneType'
    ... 'client') in the consumer's loop and ended the worker. It is delivered again instead."""
    broker.install()
    options = {"visibility_timeout": 1, "unacked_restore_throttle": 1}
    conn = Connection(redis_url, transport_options=options)
    with conn.Producer() as producer:
        for n in (1, 2):
            producer.publish({"task": n}, exchange=QUEUE.exchange, routing_key="tool",
                             declare=[QUEUE])
    channel = conn.channel()
    acked, rejected = (channel.basic_get("tool", no_ack=False) for _ in range(2))
    assert acked is not None and rejected is not None
    conn.transport.client = None  # torn down first, as kombu 5.7 does on a connection loss
    channel.close()
    acked.ack()  # raised AttributeError before the fix
    rejected.reject(requeue=True)

    time.sleep(1.2)
    with Connection(redis_url, transport_options=options) as other:
        sweeper = other.channel()
        sweeper.qos.restore_visible(num=10)
        again = [sweeper.basic_get("tool", no_ack=True) for _ in range(2)]
        assert sorted(m.payload["task"] for m in again if m is not None) == [1, 2]


def test_only_tasks_whose_result_is_awaited_subscribe_to_it(redis_url: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside a worker (the API), Celery subscribes to a task's result channel when it sends
    the task unless told to ignore its result: a round trip per submission, and a subscription
    held until the handle is collected. Only `cortex.invoke`, whose value its sender waits
    for, may subscribe."""
    monkeypatch.setattr(celery._state, "_task_join_will_block", False)  # not a worker
    sender = CeleryBroker(create_app(Settings(redis_url=redis_url)))
    client = redis.Redis.from_url(redis_url)

    def subscribes() -> int:
        stats = client.info("commandstats")
        return int(stats.get("cmdstat_subscribe", {}).get("calls", 0))

    before = subscribes()
    for n in range(5):
        sender.send_task(TURN_TASK, [f"job{n}"], queue="agent")
        sender.send_task(ACTION_TASK, [f"job{n}", "a", {}, True], queue="tool")
    assert subscribes() == before
    handle = sender.send_task(INVOKE_TASK, ["job", {"id": "a"}, 1.0], queue="tool")
    assert subscribes() > before
    handle.forget()


def test_sending_and_receiving_tasks_reuses_one_redis_client_per_channel(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """kombu built a redis-py client for every task it sent or received (about 0.2 ms each, on
    the path of every hop); a channel now keeps one until its connection pool changes."""
    broker.install()
    built = 0
    init = redis.Redis.__init__

    def counting(self: redis.Redis, *args: object, **kwargs: object) -> None:
        nonlocal built
        built += 1
        init(self, *args, **kwargs)

    with Connection(redis_url) as conn, conn.Producer() as producer:
        producer.publish({"n": -1}, exchange=QUEUE.exchange, routing_key="tool",
                         declare=[QUEUE])
        channel = conn.channel()
        assert channel.basic_get("tool", no_ack=False) is not None
        monkeypatch.setattr(redis.Redis, "__init__", counting)
        for n in range(10):
            producer.publish({"n": n}, exchange=QUEUE.exchange, routing_key="tool")
            message = channel.basic_get("tool", no_ack=False)
            assert message is not None and message.payload == {"n": n}
            message.ack()
        assert built == 0
        channel._disconnect_pools()  # as after a connection loss: a new pool, a new client
        producer.publish({"n": 10}, exchange=QUEUE.exchange, routing_key="tool")
        assert channel.basic_get("tool", no_ack=True) is not None
        assert built == 1


def test_the_broker_says_which_task_messages_it_holds(redis_url: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """What the reconciler asks before it calls a queued action's message lost: the messages
    still in a lane's list (sent, nobody took them), and those a worker took since a given
    time and has not acknowledged (kombu's unacked hash and index); a message acknowledged,
    or taken before that time (by a worker that may have died), is held no more."""
    monkeypatch.setattr(celery._state, "_task_join_will_block", False)  # not a worker
    app = create_app(Settings(redis_url=redis_url))
    sender = CeleryBroker(app)
    sender.send_task(ACTION_TASK, ["job1", "a", {}, True], queue="tool", task_id="job1:a")
    sender.send_task(ACTION_TASK, ["job2", "b", {}, True], queue="tool.3", task_id="job2:b")
    sender.send_task(ACTION_TASK, ["job3", "c", {}, True], queue="llm.15", task_id="job3:c")
    assert sender.held(time.time()) == {"job1:a", "job2:b", "job3:c"}
    with app.connection_for_read() as conn:
        channel = conn.default_channel
        before = time.time()
        taken = channel.basic_get("tool.3", no_ack=False)  # delivered, not acknowledged
        assert taken is not None
        assert sender.held(before - 1) == {"job1:a", "job2:b", "job3:c"}
        # delivered before the time asked about: its worker may have died since
        assert sender.held(time.time() + 60) == {"job1:a", "job3:c"}
        channel.basic_ack(taken.delivery_tag)
        assert sender.held(before - 1) == {"job1:a", "job3:c"}
