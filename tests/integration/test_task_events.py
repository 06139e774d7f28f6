"""Celery's task events, published by a background thread (`cortex_worker.observability.task_events`), on a
real Redis with a real event receiver (what Flower runs): they all arrive, in order, with the
time they describe, and publishing them never holds up the thread that caused them."""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

import pytest
import redis
from celery import Celery

from cortex_worker.app import create_app
from cortex_worker.observability.task_events import BackgroundDispatcher
from cortex_worker.settings import Settings
from tests import harness
from tests.integration.test_documents import follow, submit

pytestmark = pytest.mark.integration


class Captured:
    """A Celery event receiver in a thread: `events` as they arrive (with the `probe` events
    it was ready by; tests read the types they sent)."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.events: list[dict[str, Any]] = []
        self._ready = threading.Event()
        self._connection = app.connection_for_read()
        self.receiver = app.events.Receiver(self._connection, handlers={"*": self.events.append})
        self.receiver.on_consume_ready = lambda *_, **__: self._ready.set()
        self._thread = threading.Thread(target=self._capture, daemon=True)

    def _capture(self) -> None:
        self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def __enter__(self) -> Captured:
        self._thread.start()
        assert self._ready.wait(10), "the receiver did not start consuming"
        # its fanout subscription goes out with the first poll: ready once a probe came through
        probe = self.app.events.Dispatcher(self.app.connection_for_write(), hostname="probe@h")
        try:
            harness.wait_until(lambda: probe.send("probe") or any(
                e["type"] == "probe" for e in list(self.events)), timeout=10, interval=0.05,
                message="no probe event reached the receiver")
        finally:
            probe.close()
        return self

    def __exit__(self, *_: object) -> None:
        self.receiver.should_stop = True
        self._thread.join(5)
        self._connection.release()

    def wait_for(self, count: int, of: str | None = None, timeout: float = 10.0
                 ) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.events if of is None or e["type"] == of]
            if len(found) >= count:
                return found
            time.sleep(0.02)
        raise AssertionError(f"{count} event(s) {of or ''} expected, got {self.events}")


@pytest.fixture
def app(redis_url: str) -> Celery:
    return create_app(Settings(redis_url=redis_url))


def test_the_app_publishes_its_events_from_a_background_thread(app: Celery) -> None:
    dispatcher = app.events.Dispatcher(app.connection_for_write(), hostname="t@h")
    try:
        assert isinstance(dispatcher, BackgroundDispatcher)
    finally:
        dispatcher.close()


def test_events_arrive_in_order_with_the_time_they_were_sent(app: Celery) -> None:
    with Captured(app) as captured:
        dispatcher = app.events.Dispatcher(app.connection_for_write(), hostname="t@h")
        sent = []
        for n in range(200):
            sent.append(time.time())
            dispatcher.send("task-received", uuid=f"task-{n}", name="t")
        sent.append(time.time())  # after the last `send` returned
        dispatcher.close()  # publishes what is queued before it returns
        got = captured.wait_for(200, "task-received")
    assert [e["uuid"] for e in got] == [f"task-{n}" for n in range(200)]
    clocks = [e["clock"] for e in got]
    assert clocks == sorted(clocks) and len(set(clocks)) == 200
    # each timestamp is when `send` was called, not when the thread got to it: between the
    # clock read before that call and the one after it returned
    assert all(sent[n] <= e["timestamp"] <= sent[n + 1] for n, e in enumerate(got))
    assert dispatcher.dropped == 0


def test_a_slow_broker_does_not_hold_up_the_sender(app: Celery, redis_url: str) -> None:
    """Redis stops answering writes: `send` returns while it is still paused, and the event
    goes out once Redis is back."""
    with Captured(app) as captured:
        dispatcher = app.events.Dispatcher(app.connection_for_write(), hostname="t@h")
        dispatcher.send("task-received", uuid="warm", name="t")  # the thread and its connection
        captured.wait_for(1, "task-received")
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        client.execute_command("CLIENT", "PAUSE", "60000", "WRITE")
        dispatcher.send("task-succeeded", uuid="during-pause", result="1", runtime=0.1)
        # `send` has returned; the publish itself waits in Redis (a client blocked by the
        # pause, in PUBLISH) until the unpause below, and the event is not out yet
        harness.wait_until(lambda: any("b" in c["flags"] and c["cmd"] == "publish"
                                       for c in client.client_list()), timeout=10,
                           message=lambda: f"no PUBLISH held by the pause: {client.client_list()}")
        assert not [e for e in captured.events if e["type"] == "task-succeeded"]
        client.execute_command("CLIENT", "UNPAUSE")
        got = captured.wait_for(1, "task-succeeded")
        assert got[0]["uuid"] == "during-pause"
        dispatcher.close()


def test_the_task_sent_event_goes_out_after_the_sender_returned_its_producer(app: Celery
                                                                             ) -> None:
    """`task-sent` is published with the caller's producer in Celery; here the thread
    publishes it with its own, as the caller's is back in the pool (and maybe in use)."""
    with Captured(app) as captured:
        for n in range(20):
            app.send_task("cortex.nothing", args=[n], queue="relic")
        got = captured.wait_for(20, "task-sent")
    assert [e["args"] for e in got] == [repr([n]) for n in range(20)]


def _send_from_child(dispatcher: BackgroundDispatcher) -> None:
    dispatcher.send("task-received", uuid="from-the-child", name="t")
    dispatcher.close()


def test_a_forked_child_publishes_through_its_own_thread(app: Celery) -> None:
    with Captured(app) as captured:
        dispatcher = app.events.Dispatcher(app.connection_for_write(), hostname="t@h")
        dispatcher.send("task-received", uuid="from-the-parent", name="t")
        child = multiprocessing.get_context("fork").Process(target=_send_from_child,
                                                            args=(dispatcher,))
        child.start()
        child.join(10)
        assert child.exitcode == 0
        got = captured.wait_for(2, "task-received")
        dispatcher.close()
    assert {e["uuid"] for e in got} == {"from-the-parent", "from-the-child"}


def test_a_jobs_tasks_are_seen_as_flower_sees_them(api: harness.Process,
                                                   workers: dict[str, harness.Process],
                                                   cortex_env: dict[str, str]) -> None:
    """A document job through the real API and workers: each action's task is sent,
    received, started and succeeded, the worker's three in that order of time. (`task-sent`
    is made once the task is in the queue, so a quick worker may receive it first.)"""
    app = create_app(Settings(redis_url=cortex_env["CORTEX_REDIS_URL"]))
    with Captured(app) as captured:
        doc = ('<action type="tool" mode="async" id="e1">{"name": "echo", '
               '"parameters": {"message": "hi"}}</action>')
        created = submit(api, doc)
        assert created.status_code == 202, created.text
        job_id = created.json()["id"]
        assert follow(api, job_id)[-1]["type"] == "job_completed"
        task_id = f"{job_id}:e1"
        deadline = time.monotonic() + 10
        kinds: dict[str, float] = {}
        while time.monotonic() < deadline and len(kinds) < 4:
            kinds = {e["type"]: e["timestamp"] for e in list(captured.events)
                     if e.get("uuid") == task_id}
            time.sleep(0.05)
    assert {"task-sent", "task-received", "task-started", "task-succeeded"} <= set(kinds), \
        (task_id, kinds, captured.events[-10:])
    times = [kinds[k] for k in ("task-received", "task-started", "task-succeeded")]
    assert times == sorted(times), kinds
