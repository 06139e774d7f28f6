"""The worker's BRPOP over its pool's lanes and priorities (cortex_worker.worker.kombu_fixes):
each lane's priority lists together, the lanes in the order of kombu's round-robin cycle, so a
priority orders its tenant's own lane and never puts one tenant before another."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import redis
from kombu.transport import redis as kombu_redis
from kombu.utils.scheduling import cycle_by_name

from cortex_worker.pools import KOMBU_PRIORITY_SEP, PRIORITIES
from cortex_worker.worker import kombu_fixes

pytestmark = pytest.mark.unit


class _Connection:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []

    def send_command(self, *args: Any) -> None:
        self.sent.append(args)


class _Client:
    def __init__(self) -> None:
        self.connection = _Connection()


class _PackingConnection(redis.connection.Connection):
    """redis-py's connection, never connected: what it would write to the socket is kept."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[Any] = []

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        self.written.append(command)


def _channel(client: Any) -> Any:
    kombu_fixes.install()
    assert kombu_redis.Channel._brpop_start is kombu_fixes._brpop_lane_by_lane
    channel: Any = object.__new__(kombu_redis.Channel)  # only what _brpop_start reads
    channel.brpop_timeout = 1
    channel.priority_steps = list(range(PRIORITIES))
    channel.sep = KOMBU_PRIORITY_SEP
    channel.global_keyprefix = ""
    channel._queue_cycle = cycle_by_name("round_robin")()
    channel._queue_cycle.update(["tool", "tool.1", "tool.2"])
    channel._active_queues = ["tool", "tool.1", "tool.2"]
    channel.active_fanout_queues = set()
    channel.client = client
    return channel


def lists(lane: str) -> list[str]:
    return [lane if p == 0 else f"{lane}{KOMBU_PRIORITY_SEP}{p}" for p in range(PRIORITIES)]


def test_the_brpop_lists_each_lanes_priorities_together_lane_after_lane() -> None:
    channel = _channel(_Client())
    channel._queue_cycle.rotate("tool")  # kombu moved the lane it just took from to the end
    channel._brpop_start()
    (command,) = channel.client.connection.sent
    assert command[0] == "BRPOP" and command[-1] == 1
    keys = list(command[1:-1])
    assert keys == lists("tool.1") + lists("tool.2") + lists("tool")


def test_each_turn_of_the_cycle_packs_its_brpop_once() -> None:
    connection = _PackingConnection()
    channel = _channel(SimpleNamespace(connection=connection))
    packer = connection._command_packer
    channel._queue_cycle.rotate("tool")
    channel._brpop_start()
    channel._queue_cycle.rotate("tool.1")
    channel._brpop_start()
    channel._queue_cycle.rotate("tool.2")
    channel._brpop_start()
    channel._queue_cycle.rotate("tool")  # back to the first turn's order
    channel._brpop_start()
    first, second, third, fourth = connection.written
    assert first == packer.pack("BRPOP", *lists("tool.1"), *lists("tool.2"), *lists("tool"), 1)
    assert second == packer.pack("BRPOP", *lists("tool.2"), *lists("tool"), *lists("tool.1"), 1)
    assert third == packer.pack("BRPOP", *lists("tool"), *lists("tool.1"), *lists("tool.2"), 1)
    assert fourth is first  # packed once, sent again as it was
    assert channel._in_poll is connection
