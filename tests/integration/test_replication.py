"""Writes a failover cannot take back (cortex_worker/store/replication.py), with a real master,
replica and three sentinels on loopback (tests/sentinel.py): a write of job state returns once
the replica has it, and a replica that does not answer lets the write go on, counted."""

from __future__ import annotations

import json
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from cortex_worker.observability.metrics import CortexCollector
from cortex_worker.store.keys import job_keys, write_memo_key
from cortex_worker.store.state import Store
from tests.sentinel import SentinelCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelCluster]:
    with SentinelCluster(Path(tmp_path_factory.mktemp("replication"))) as running:
        yield running


def _replica(cluster: SentinelCluster) -> redis.Redis:
    master = cluster.master_port()
    (port,) = [n.port for n in cluster.nodes if n.port != master and n.running]
    return redis.Redis(port=port, decode_responses=True)


def _job(store: Store) -> str:
    job_id = f"repl-{uuid.uuid4().hex[:8]}"
    store.create_job(job_id, {"kind": "document"}, ttl=600, events=[("job_queued", {})])
    return job_id


def test_a_write_returns_once_the_replica_has_it(cluster: SentinelCluster) -> None:
    store = Store.from_url(cluster.url)
    replica = _replica(cluster)
    job_id = _job(store)
    assert replica.hget(job_keys(job_id).job, "status") == "queued"  # create_job's barrier
    assert store.begin(job_id, [("job_started", {})]) == "started"
    spec = {"id": "a", "type": "tool", "name": "echo"}
    store.register(job_id, [{"id": "a", "spec": json.dumps(spec), "deps": [], "after": [],
                             "on_error": "fail"}], close=True)
    assert store.claim(job_id, "a", "host:1", 60.0)[:2] == ["run", 1]
    assert replica.hget(job_keys(job_id).attempts, "a") == "1"
    store.finish(job_id, "a", "ok", {"status": "ok", "value": 1}, 1, None,
                 ("action_completed", {"action_id": "a", "result": 1}), attempt=1,
                 holder="host:1")
    assert json.loads(replica.hget(job_keys(job_id).result, "a"))["value"] == 1
    seq = store.emit_many({(job_id, None): [("warning", {"message": "batched"})]})
    assert seq == []
    log = [json.loads(fields["e"]) for _, fields in replica.xrange(job_keys(job_id).events)]
    assert [e["type"] for e in log][-2:] == ["action_completed", "warning"]
    assert [e["seq"] for e in log] == list(range(1, len(log) + 1))


def test_a_replica_that_does_not_answer_lets_writes_go_on_counted(
        cluster: SentinelCluster) -> None:
    store = Store.from_url(cluster.url, replica_wait_ms=200)
    job_id = _job(store)
    replica = cluster.node(_replica(cluster).connection_pool.connection_kwargs["port"])
    replica.process.kill(signal.SIGSTOP)  # it stays connected, and acknowledges nothing
    try:
        assert store.emit(job_id, [("warning", {"message": "not acknowledged"})]) > 0
    finally:
        replica.process.kill(signal.SIGCONT)
    family = next(f for f in CortexCollector(store.redis).collect()
                  if f.name == "cortex_unreplicated_writes")
    counted = {s.labels["write"]: s.value for s in family.samples if s.name.endswith("_total")}
    assert counted.get("emit", 0) >= 1


def test_a_write_sent_again_is_applied_once(cluster: SentinelCluster) -> None:
    """As redis-py sends a command again when the reply was lost (the same write id): the
    second run changes nothing and answers as the first did."""
    store = Store.from_url(cluster.url)
    job_id = _job(store)
    script = store._scripts["emit"]
    keys = list(job_keys(job_id)[:16])
    argv = [job_id, "1700000000.0|0123456789abcdef", "0", "", "", "warning", '{"n":1}']
    first = script(keys=keys, args=argv)
    assert store.redis.get(write_memo_key(job_id, "0123456789abcdef")) == str(first)
    assert script(keys=keys, args=argv) == first
    assert [e["type"] for e in store.events_after(job_id)] == ["job_queued", "warning"]
    argv[1] = "1700000000.0|fedcba9876543210"  # another write: it is applied
    assert script(keys=keys, args=argv) == first + 1
