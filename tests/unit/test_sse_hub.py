"""The SSE hub's pure parts: wire format, resume point, cursor, fan-out, and one stream's logic.

Redis-backed behaviour (pub/sub, XRANGE) is covered by the integration tests; here the stream runs
against an in-memory event source.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from cortex_api import sse
from cortex_api.sse import (
    Cursor,
    EventHub,
    Fanout,
    Listener,
    event_stream,
    format_event,
    resume_point,
    sse_comment,
    sse_message,
)
from cortex_worker.store.keys import channel

pytestmark = pytest.mark.unit


def ev(seq: int, kind: str = "text", **data: Any) -> dict[str, Any]:
    return {"job_id": "j1", "seq": seq, "ts": 1.5, "type": kind, "data": data}


def parse(messages: list[str]) -> list[tuple[int, str]]:
    """(seq, type) of each event message; comments are skipped."""
    out = []
    for message in messages:
        if message.startswith(":"):
            continue
        fields = dict(line.split(": ", 1) for line in message.strip("\n").split("\n"))
        body = json.loads(fields["data"])
        assert int(fields["id"]) == body["seq"] and fields["event"] == body["type"]
        out.append((body["seq"], body["type"]))
    return out


class FakeSource:
    """An EventSource over a list: records the order of subscribe and reads."""

    def __init__(self, log: list[dict[str, Any]], status: str | None = "running",
                 queue_size: int = 100) -> None:
        self.log = log
        self.job_status = status
        self.calls: list[str] = []
        self.listener = Listener(queue_size)
        self.left = False
        self.fails: Callable[[int], bool] = lambda read: False  # read n (1 = the first) fails
        self.reads = 0

    @asynccontextmanager
    async def listen(self, job_id: str) -> AsyncIterator[Listener]:
        self.calls.append("listen")
        try:
            yield self.listener
        finally:
            self.left = True

    async def read(self, job_id: str, after: int, count: int) -> list[dict[str, Any]]:
        self.calls.append(f"read>{after}")
        self.reads += 1
        if self.fails(self.reads):
            raise RedisConnectionError("No connection available.")
        return [e for e in self.log if e["seq"] > after][:count]

    async def status(self, job_id: str) -> str | None:
        return self.job_status


async def collect(source: FakeSource, after: int = 0, **kwargs: Any) -> list[str]:
    return [m async for m in event_stream(source, "j1", after, **kwargs)]


async def until(predicate: Any, timeout: float = 2.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.001)


# -- wire format --------------------------------------------------------------------------
def test_format_event_is_one_sse_message() -> None:
    text = format_event(ev(7, "action_completed", action_id="a", result="x\ny"))
    assert text.endswith("\n\n") and text.count("\n") == 4
    lines = text.split("\n")
    assert lines[0] == "id: 7" and lines[1] == "event: action_completed"
    assert json.loads(lines[2].removeprefix("data: "))["data"]["result"] == "x\ny"


def test_multiline_data_and_comments() -> None:
    assert sse_message("a\nb", event="e", id=1) == "id: 1\nevent: e\ndata: a\ndata: b\n\n"
    assert sse_message("") == "data: \n\n"
    assert sse_comment("keep-alive") == ": keep-alive\n\n"


def test_resume_point() -> None:
    assert resume_point(None, 0) == 0
    assert resume_point(None, 5) == 5
    assert resume_point("12", 5) == 12  # Last-Event-ID wins over ?after=
    assert resume_point(" ", 3) == 3
    for bad in ("x", "-1", "1.5"):
        with pytest.raises(ValueError, match="Last-Event-ID"):
            resume_point(bad)


# -- cursor -------------------------------------------------------------------------------
def test_cursor_classifies_and_dedupes() -> None:
    cursor = Cursor(3)
    assert [cursor.classify(s) for s in (2, 3, 4, 6)] == ["old", "old", "next", "gap"]
    assert cursor.admit(ev(4)) and cursor.last == 4
    assert not cursor.admit(ev(4)) and not cursor.admit(ev(1))
    assert cursor.last == 4


# -- fan-out ------------------------------------------------------------------------------
def test_fanout_first_and_last_listener() -> None:
    fan, a, b = Fanout(), Listener(), Listener()
    assert fan.add("c", a) is True
    assert fan.add("c", b) is False
    assert fan.publish("c", ev(1)) == 2 and fan.publish("other", ev(1)) == 0
    assert a.queue.get_nowait() == ev(1) and b.queue.get_nowait() == ev(1)
    assert fan.remove("c", a) is False
    assert fan.remove("c", b) is True
    assert fan.channels() == [] and len(fan) == 0
    assert fan.remove("c", b) is False


def test_fanout_drops_only_the_slow_listener() -> None:
    fan, slow, fast = Fanout(), Listener(maxsize=2), Listener(maxsize=10)
    fan.add("c", slow)
    fan.add("c", fast)
    for seq in (1, 2, 3):
        fan.publish("c", ev(seq))
    assert slow.overflowed and not fast.overflowed
    assert fast.queue.qsize() == 3 and len(fan) == 1
    assert fan.publish("c", ev(4)) == 1
    assert fan.remove("c", slow) is False  # the fast one still listens
    assert fan.remove("c", fast) is True


def test_fanout_keeps_channel_until_the_overflowed_listener_leaves() -> None:
    fan, slow = Fanout(), Listener(maxsize=1)
    fan.add("c", slow)
    fan.publish("c", ev(1))
    fan.publish("c", ev(2))
    assert slow.overflowed
    assert fan.add("c", Listener()) is False  # still subscribed: no second SUBSCRIBE


def test_fanout_resync_wakes_every_listener() -> None:
    fan, a, b = Fanout(), Listener(), Listener()
    fan.add("x", a)
    fan.add("y", b)
    fan.resync()
    assert a.queue.get_nowait() is None and b.queue.get_nowait() is None


def test_hub_routes_messages_without_redis() -> None:
    async def main() -> None:
        hub = EventHub.from_url("redis://127.0.0.1:1/0")  # never connected in this test
        listener = Listener()
        hub._fanout.add(channel("j1"), listener)
        hub._confirmed[channel("j1")] = confirmed = asyncio.Event()
        hub._on_message({"type": "subscribe", "channel": channel("j1"), "data": 1})
        hub._on_message({"type": "message", "channel": channel("j1"), "data": json.dumps(ev(1))})
        hub._on_message({"type": "message", "channel": channel("j1"), "data": "not json"})
        hub._on_message({"type": "message", "channel": channel("j2"), "data": json.dumps(ev(1))})
        assert confirmed.is_set()
        assert listener.queue.qsize() == 1 and listener.queue.get_nowait() == ev(1)
        assert hub.stats() == {"channels": 1, "listeners": 1}

    asyncio.run(main())


# -- one stream ---------------------------------------------------------------------------
def test_finished_job_replays_then_closes_and_subscribes_first() -> None:
    source = FakeSource([ev(1, "job_queued"), ev(2, "job_started"), ev(3, "job_completed")],
                        status="completed")
    out = asyncio.run(collect(source))
    assert parse(out) == [(1, "job_queued"), (2, "job_started"), (3, "job_completed")]
    assert source.calls[0] == "listen" and source.left


def test_resume_after_a_seq() -> None:
    source = FakeSource([ev(1), ev(2), ev(3, "job_failed")], status="failed")
    assert parse(asyncio.run(collect(source, after=2))) == [(3, "job_failed")]


def test_replay_reads_in_pages() -> None:
    log = [ev(s) for s in range(1, 6)] + [ev(6, "job_cancelled")]
    source = FakeSource(log, status="cancelled")
    out = asyncio.run(collect(source, page=2))
    assert [s for s, _ in parse(out)] == [1, 2, 3, 4, 5, 6]
    assert source.calls[1:4] == ["read>0", "read>2", "read>4"]


def test_finished_job_without_a_last_event_still_closes() -> None:
    source = FakeSource([ev(1, "job_queued")], status="completed")
    assert parse(asyncio.run(collect(source))) == [(1, "job_queued")]


def test_live_events_are_deduped_against_the_replay() -> None:
    async def main() -> list[str]:
        source = FakeSource([ev(1), ev(2), ev(3)])
        # published between SUBSCRIBE and the replay: already queued, and in the log
        source.listener.offer(ev(3))
        out: list[str] = []

        async def run() -> None:
            async for message in event_stream(source, "j1"):
                out.append(message)

        task = asyncio.create_task(run())
        await until(lambda: len(out) == 3)
        source.listener.offer(ev(2))  # duplicate
        source.log.append(ev(4, "job_completed"))
        source.listener.offer(ev(4, "job_completed"))
        await asyncio.wait_for(task, 2)
        return out

    assert [s for s, _ in parse(asyncio.run(main()))] == [1, 2, 3, 4]


def test_gap_before_a_live_event_is_filled_from_the_log() -> None:
    async def main() -> tuple[list[str], FakeSource]:
        source = FakeSource([ev(1)])
        out: list[str] = []

        async def run() -> None:
            async for message in event_stream(source, "j1"):
                out.append(message)

        task = asyncio.create_task(run())
        await until(lambda: len(out) == 1)
        source.log += [ev(2), ev(3), ev(4)]
        source.listener.offer(ev(4))  # 2 and 3 were lost on the live path
        await until(lambda: len(out) == 4)
        source.listener.offer(ev(3))  # late duplicate
        source.log.append(ev(5, "job_completed"))
        source.listener.offer(ev(5, "job_completed"))
        await asyncio.wait_for(task, 2)
        return out, source

    out, source = asyncio.run(main())
    assert [s for s, _ in parse(out)] == [1, 2, 3, 4, 5]
    assert "read>1" in source.calls


def test_live_event_missing_from_the_log_is_still_sent() -> None:
    async def main() -> list[str]:
        source = FakeSource([ev(1)])
        source.listener.offer(ev(3, "job_completed"))  # seq 2 is gone from the log
        return await asyncio.wait_for(collect(source), 2)

    assert [s for s, _ in parse(asyncio.run(main()))] == [1, 3]


def test_resync_marker_catches_up_from_the_log() -> None:
    async def main() -> list[str]:
        source = FakeSource([ev(1)])
        out: list[str] = []

        async def run() -> None:
            async for message in event_stream(source, "j1"):
                out.append(message)

        task = asyncio.create_task(run())
        await until(lambda: len(out) == 1)
        source.log += [ev(2), ev(3, "job_completed")]
        source.listener.offer(None)  # the pub/sub connection dropped: messages may be lost
        await asyncio.wait_for(task, 2)
        return out

    assert [s for s, _ in parse(asyncio.run(main()))] == [1, 2, 3]


def test_quiet_stream_sends_heartbeats_and_notices_the_end() -> None:
    async def main() -> list[str]:
        source = FakeSource([ev(1)])
        out: list[str] = []

        async def run() -> None:
            async for message in event_stream(source, "j1", heartbeat_s=0.01):
                out.append(message)

        task = asyncio.create_task(run())
        await until(lambda: ": keep-alive\n\n" in out)
        # the job ends but its live message never arrives: the idle check finds it
        source.log.append(ev(2, "job_completed"))
        source.job_status = "completed"
        await asyncio.wait_for(task, 2)
        return out

    out = asyncio.run(main())
    assert [s for s, _ in parse(out)] == [1, 2]


def test_overflowed_client_is_disconnected() -> None:
    async def main() -> tuple[list[str], FakeSource]:
        source = FakeSource([ev(1)], queue_size=1)
        source.listener.offer(ev(2))
        source.listener.offer(ev(3))  # queue full: too slow
        return await asyncio.wait_for(collect(source), 2), source

    out, source = asyncio.run(main())
    assert parse(out) == [(1, "text")]
    assert out[-1].startswith(": too slow") and source.left


# -- Redis errors in the middle of a stream -------------------------------------------------
@pytest.fixture
def short_pauses(monkeypatch: pytest.MonkeyPatch) -> tuple[float, ...]:
    pauses = (0.001, 0.002, 0.003)
    monkeypatch.setattr(sse, "REDIS_PAUSES_S", pauses)
    return pauses


def test_a_redis_error_mid_stream_reads_again_from_where_it_stopped(short_pauses: Any) -> None:
    async def main() -> tuple[list[str], FakeSource]:
        source = FakeSource([ev(s) for s in range(1, 6)] + [ev(6, "job_completed")],
                            status="completed")
        source.fails = {2, 3}.__contains__  # after the first page, twice (a lost connection, then
        return await asyncio.wait_for(collect(source, page=2), 2), source  # a full pool)

    out, source = asyncio.run(main())
    assert [s for s, _ in parse(out)] == [1, 2, 3, 4, 5, 6]  # none twice, none missing
    retries = [m for m in out if m.startswith(": Redis is unavailable")]
    assert len(retries) == 2 and "reading again in 0.001s" in retries[0]
    # subscribed again each time, and read on after the last event sent (6 ends it)
    assert source.calls == ["listen", "read>0", "read>2", "listen", "read>2",
                            "listen", "read>2", "read>4"]
    assert source.left


def test_a_stream_gives_up_only_when_redis_stays_away(short_pauses: Any) -> None:
    source = FakeSource([ev(1), ev(2)])
    source.fails = lambda read: True
    out = asyncio.run(asyncio.wait_for(collect(source), 2))
    assert parse(out) == []
    assert len([m for m in out if "reading again" in m]) == len(short_pauses)
    assert out[-1].startswith(": Redis is unavailable") and "reconnect with Last-Event-ID" in out[-1]


def test_each_outage_gets_the_whole_budget_of_pauses(short_pauses: Any) -> None:
    log = [ev(s) for s in range(1, 8)] + [ev(8, "job_completed")]
    source = FakeSource(log, status="completed")
    # reads: 1 ok (1-2), 2-4 fail (three pauses), 5 ok (3-4), 6-8 fail, 9 ok (5-6), ...
    source.fails = {2, 3, 4, 6, 7, 8}.__contains__
    out = asyncio.run(asyncio.wait_for(collect(source, page=2), 2))
    assert [s for s, _ in parse(out)] == list(range(1, 9))
    assert not any("reconnect" in m for m in out)


def test_a_client_that_goes_away_leaves_the_hub_at_once() -> None:
    async def main() -> bool:
        source = FakeSource([ev(1)])
        stream = event_stream(source, "j1")
        assert parse([await anext(stream)]) == [(1, "text")]
        await stream.aclose()  # the client disconnected
        return source.left  # not left to a later finalizer task

    assert asyncio.run(main())
