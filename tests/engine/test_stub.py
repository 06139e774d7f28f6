"""`StubBroker` itself, on a Celery app of its own (no Redis): order, countdowns, revokes, lost
messages, errors, canvases, and `dispatch.use_broker`."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery, chain, group

from cortex_worker.actions import dispatch
from cortex_worker.testing import CANVAS, StubBroker, StubBrokerError

app = Celery("stub-test", set_as_current=False)
calls: list[Any] = []
current: list[StubBroker] = []


@app.task(name="t.record")
def record(value: Any) -> Any:
    calls.append(value)
    return value


@app.task(name="t.boom")
def boom(message: str) -> None:
    raise ValueError(message)


@app.task(name="t.loop")
def loop() -> None:
    calls.append("loop")
    current[0].send_task("t.loop", [], queue="q", countdown=1)


@pytest.fixture
def stub() -> StubBroker:
    calls.clear()
    current[:] = [StubBroker(app)]
    return current[0]


def test_messages_run_in_order_and_countdowns_when_they_fall_due(stub: StubBroker) -> None:
    stub.send_task("t.record", ["late"], queue="a", countdown=5)
    stub.send_task("t.record", ["first"], queue="b")
    stub.send_task("t.record", ["soon"], queue="a", countdown=1)
    stub.send_task("t.record", ["second"], queue="a", countdown=0)
    assert {q: [m.args[0] for m in ms] for q, ms in stub.queues.items()} == {
        "a": ["late", "soon", "second"], "b": ["first"]}
    assert stub.join(delayed=False) == 2
    assert calls == ["first", "second"]
    assert [m.args[0] for m in stub.messages()] == ["late", "soon"]
    assert stub.join() == 2
    assert calls == ["first", "second", "soon", "late"]
    assert stub.clock == 5
    assert [m.state for m in stub.sent] == ["done"] * 4


def test_revoke_drops_only_what_is_queued(stub: StubBroker) -> None:
    stub.send_task("t.record", [1], queue="q", task_id="x")
    stub.send_task("t.record", [2], queue="q", task_id="y")
    stub.revoke(["x", "gone"])
    assert stub.revoked == ["x", "gone"]
    stub.send_task("t.record", [3], queue="q", task_id="x")  # sent after the revoke
    stub.join()
    assert calls == [2, 3]
    assert [m.state for m in stub.messages(task_id="x", sent=True)] == ["revoked", "done"]


def test_a_dropped_message_never_runs(stub: StubBroker) -> None:
    kept = stub.send_task("t.record", ["kept"], queue="q")
    lost = stub.send_task("t.record", ["lost"], queue="q")
    assert stub.drop(where=lambda m: m.args == ["lost"]) == [lost.message]
    assert stub.join() == 1 and calls == ["kept"]
    assert kept.get() == "kept"
    with pytest.raises(StubBrokerError, match="it was dropped"):
        lost.get()


def test_get_runs_a_message_at_once(stub: StubBroker) -> None:
    stub.send_task("t.record", ["before"], queue="q")
    result = stub.send_task("t.record", ["waited for"], queue="q")
    assert result.get(timeout=1) == "waited for"
    assert calls == ["waited for"]
    stub.join()
    assert calls == ["waited for", "before"]


def test_a_task_error_propagates_and_the_rest_stays_queued(stub: StubBroker) -> None:
    failing = stub.send_task("t.boom", ["bad"], queue="q")
    stub.send_task("t.record", ["after"], queue="q")
    with pytest.raises(ValueError, match="bad"):
        stub.join()
    assert failing.message.state == "failed" and calls == []
    with pytest.raises(ValueError, match="bad"):
        failing.get()
    assert failing.get(propagate=False) is None
    assert stub.join() == 1 and calls == ["after"]


def test_an_unknown_task_is_an_error(stub: StubBroker) -> None:
    stub.send_task("t.nothing", [], queue="q")
    with pytest.raises(StubBrokerError, match=r"no task named 't\.nothing'"):
        stub.join()


def test_join_stops_a_message_that_always_sends_another(stub: StubBroker) -> None:
    stub.send_task("t.loop", [], queue="q")
    with pytest.raises(StubBrokerError, match="still sending messages after 50"):
        stub.join(max_messages=50)
    assert calls == ["loop"] * 50
    assert stub.join(delayed=False) == 0  # the next one waits for its countdown


def test_a_canvas_runs_eagerly_in_order(stub: StubBroker) -> None:
    canvas = chain(record.si(1).set(queue="first"),
                   group(record.si(2), chain(record.si(3), record.si(4))),
                   record.si(5))
    message = stub.apply_canvas(canvas)
    assert (message.name, message.queue) == (CANVAS, "first")
    stub.join()
    assert calls == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("canvas", [
    chain(record.si(1), boom.si("in a chain"), record.si(2)),
    group(record.si(1), boom.si("in a group")),
    chain(group(record.si(1), boom.si("in a chord")), record.si(2)),
    chain(record.si(1), boom.si("last")),
], ids=["chain", "group", "chord", "last"])
def test_a_failing_canvas_step_propagates(stub: StubBroker, canvas: Any) -> None:
    stub.apply_canvas(canvas)
    with pytest.raises(ValueError):
        stub.join()
    assert calls == [1]


def test_use_broker_swaps_and_restores(stub: StubBroker) -> None:
    default = dispatch.current_broker()
    assert isinstance(default, dispatch.CeleryBroker)
    with dispatch.use_broker(stub) as installed:
        assert installed is stub and dispatch.current_broker() is stub
        other = StubBroker(app)
        with dispatch.use_broker(other):
            assert dispatch.current_broker() is other
        assert dispatch.current_broker() is stub
    assert dispatch.current_broker() is default
