"""The SSE hub and the nodes it reads, with real redis-servers.

- A replica that does not have a job: one still syncing after a failover (the old master
  rejoining), or cut off from its master while the job was made. Two servers stand for the two
  nodes: the hub's replica, which lacks the job, and the master, which has it and its whole
  log. A stream of the job must be served from the master, in full: not refused (its status
  read as missing: a 404), nor ended at once (a missing status reads as ended), nor sent
  without its events.
- A node that freezes with the hub subscribed (SIGSTOP: its kernel still acknowledges what is
  sent, so nothing fails): the hub asks for a PONG, connects again without one, and hears the
  job's events again once the node answers."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff

from cortex_api.sse import EventHub, job_events
from cortex_worker.store.connect import PUBSUB_PING_S, READ_TIMEOUT_S, async_client
from cortex_worker.store.keys import channel, job_keys
from tests import harness

JOB = "0f" * 16
KINDS = ["job_started", "action_queued", "action_started", "action_completed", "job_completed"]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(the replica's URL, the master's URL): two empty redis-servers."""
    root: Path = tmp_path_factory.mktemp("sse-replica")
    with harness.RedisServer(log_dir=root, data_dir=root / "replica") as replica, \
            harness.RedisServer(log_dir=root, data_dir=root / "master") as master:
        yield replica.url, master.url


def write_job(url: str, status: str = "completed") -> None:
    """The job as the store keeps it: its record, and its log (one stream entry an event)."""
    client = redis.Redis.from_url(url, decode_responses=True)
    keys = job_keys(JOB)
    client.hset(keys.job, mapping={"status": status, "tenant": "acme", "session": "s1"})
    for seq, kind in enumerate(KINDS, 1):
        event = {"job_id": JOB, "seq": seq, "ts": 1.0 + seq, "type": kind, "data": {}}
        client.xadd(keys.events, {"e": json.dumps(event)}, id=f"{seq}-0")
    client.close()


async def follow(hub: EventHub) -> list[Any]:
    return [item async for item in job_events(hub, JOB, heartbeat_s=0.2)]


def hub_of(replica: str, master: str) -> EventHub:
    """A hub as `EventHub.from_url` makes one behind Sentinel, on these two nodes."""
    def client(url: str, **options: Any) -> Any:
        return async_client(url, retry=AsyncRetry(NoBackoff(), 0), **options)
    return EventHub(client(replica, max_connections=2), client(replica),
                    master=client(master, max_connections=2), poll_s=0.2)


def test_a_job_the_replica_lacks_is_read_from_the_master(nodes: tuple[str, str]) -> None:
    replica, master = nodes
    for url in nodes:
        redis.Redis.from_url(url).flushdb()
    write_job(master)

    async def run() -> tuple[Any, ...]:
        hub = hub_of(replica, master)
        try:
            return (await hub.status_and_tenant(JOB), await hub.session(JOB),
                    await follow(hub), await hub.status("no-such-job"))
        finally:
            await hub.aclose()

    found, session, items, unknown = asyncio.run(run())
    assert found == ("completed", "acme") and session == "s1"
    events = [item for item in items if not isinstance(item, str)]
    assert [(e["seq"], e["type"]) for e in events] == list(enumerate(KINDS, 1))
    assert unknown is None  # neither node has it: still none


def test_a_job_the_replica_has_is_read_there(nodes: tuple[str, str]) -> None:
    """The replica is read when it has the job, even if the master's copy is ahead (it
    catches up: the stream follows the replica, as ever)."""
    replica, master = nodes
    for url in nodes:
        redis.Redis.from_url(url).flushdb()
    write_job(replica, status="completed")
    write_job(master, status="running")

    async def run() -> Any:
        hub = hub_of(replica, master)
        try:
            return await hub.status_and_tenant(JOB)
        finally:
            await hub.aclose()

    assert asyncio.run(run()) == ("completed", "acme")


def test_the_hub_leaves_a_frozen_node_and_hears_events_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="cortex_api.sse")
    with harness.RedisServer(log_dir=tmp_path, data_dir=tmp_path / "redis") as server:
        process = server.process
        assert process is not None
        publisher = server.client(decode_responses=True)

        def lost() -> bool:
            return any("no answer to a PING" in r.getMessage() for r in caplog.records)

        async def heard(listener: Any, seq: int) -> None:
            """Publish event `seq` until the listener has it (None: resync markers)."""
            event = json.dumps({"job_id": JOB, "seq": seq, "ts": 1.0, "type": "text", "data": {}})
            for _ in range(600):
                publisher.publish(channel(JOB), event)
                try:
                    while (item := await asyncio.wait_for(listener.get(), 0.2)) is None:
                        pass
                except TimeoutError:
                    continue
                assert item["seq"] == seq
                return
            raise AssertionError(f"event {seq} never reached the listener")

        async def run() -> None:
            hub = EventHub.from_url(server.url)
            try:
                async with hub.listen(JOB) as listener:
                    await heard(listener, 1)
                    # quiet for longer than PUBSUB_PING_S: its PING is answered, nothing lost
                    await asyncio.sleep(PUBSUB_PING_S + READ_TIMEOUT_S + 2)
                    assert not lost(), caplog.text
                    process.kill(signal.SIGSTOP)
                    try:
                        for _ in range(600):  # up to 120 s, a backstop
                            if lost():
                                break
                            await asyncio.sleep(0.2)
                        assert lost(), "the hub never left the frozen node"
                    finally:
                        process.kill(signal.SIGCONT)
                    await heard(listener, 2)  # subscribed again, on a new connection
            finally:
                await hub.aclose()

        try:
            asyncio.run(run())
        finally:
            publisher.close()
