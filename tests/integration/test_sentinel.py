"""Cortex behind Redis Sentinel, with real servers: a master, its replica and three sentinels
on loopback (tests/sentinel.py), the API and workers given the `redis+sentinel://` URL.

- a job runs end to end;
- the master killed with jobs in flight: the replica is promoted, every job completes, every
  action has one terminal event, /readyz comes back, and the old master back as a replica
  changes nothing for Cortex (it follows the sentinels, not an address);
- the master frozen (SIGSTOP: its connections stay open and its kernel still answers TCP,
  as in a paused VM) with jobs in flight: commands already sent to it time out and are sent
  again to the promoted replica, and every job completes with each action recorded once and
  its log's seqs 1..n; woken (SIGCONT), the old master rejoins as a replica;
- a Redis that is a replica (a plain URL naming it): POST is a 503 that says read-only, and
  so is /readyz;
- a worker that cannot go on (a read-only broker, a malformed URL) exits non-zero.

Recovery times and the reconciler's re-sends are printed (`-s`), never asserted: they depend
on the machine. Message loss on the broker's broken connections is not solved here: the
reconciler re-sends what was lost (the `action_redriven` warnings counted below).
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cortex_worker.app import create_app
from cortex_worker.protocol.events import ACTION_END_EVENTS, TERMINAL_EVENTS
from cortex_worker.settings import Settings
from cortex_worker.store.state import Store
from tests import harness
from tests.integration.conftest import MANIFESTS_DIR
from tests.integration.test_documents import action, follow, submit
from tests.sentinel import SentinelCluster, in_sync, role

JOBS_UNDER_LOAD = 40
JOBS_FROZEN = 30
POOLS = {"agent": 2, "tool": 4}


class SentinelStack:
    """The cluster, and the API and workers that know it only by its `redis+sentinel://` URL."""

    def __init__(self, cluster: SentinelCluster, env: dict[str, str], log_dir: Path) -> None:
        self.cluster, self.env, self.log_dir = cluster, env, log_dir
        self.workers = harness.start_workers(POOLS, env, log_dir=log_dir, cwd=log_dir, wait=False)
        # The harness's control app takes the URL as Celery's broker URL; Cortex's own app
        # turns a Sentinel URL into kombu's form.
        control = create_app(Settings(redis_url=cluster.url, manifests=MANIFESTS_DIR))
        try:
            harness.wait_workers_ready(list(self.workers.values()), env, app=control)
        finally:
            control.close()
        self.api = harness.start_api(env, log_dir=log_dir, cwd=log_dir)
        self.store = Store.from_url(cluster.url)

    def close(self) -> None:
        self.store.redis.close()
        harness.stop_all(processes=[self.api, *self.workers.values()])


@pytest.fixture(scope="module")
def stack(cortex_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[SentinelStack]:
    where = tmp_path_factory.mktemp("sentinel")
    with SentinelCluster(where) as cluster:
        env = {**cortex_env, "CORTEX_REDIS_URL": cluster.url}
        running = SentinelStack(cluster, env, where)
        try:
            yield running
        finally:
            running.close()


def ready(api: harness.Process) -> httpx.Response:
    return httpx.get(f"{api.url}/readyz", timeout=10)


def job_status(api: harness.Process, job_id: str) -> str | None:
    """The job's status, None while the API cannot answer (Redis failing over)."""
    try:
        response = httpx.get(f"{api.url}/v1/jobs/{job_id}", timeout=60)
    except httpx.HTTPError:
        return None
    return response.json()["status"] if response.status_code == 200 else None


def terminal_events(events: list[dict[str, Any]]) -> Counter[str]:
    """How many terminal events each action has."""
    return Counter(e["data"]["action_id"] for e in events if e["type"] in ACTION_END_EVENTS)


def test_a_job_runs_end_to_end_behind_sentinel(stack: SentinelStack) -> None:
    doc = action("a", "echo", {"message": "hi"}) + action("b", "echo", {"message": "$a"},
                                                         depends_on="a")
    response = submit(stack.api, doc)
    assert response.status_code == 202, response.text
    events = follow(stack.api, response.json()["id"])
    assert events[-1]["type"] == "job_completed", [e["type"] for e in events]
    assert terminal_events(events) == {"a": 1, "b": 1}
    assert ready(stack.api).status_code == 200


def test_the_master_killed_under_load(stack: SentinelStack) -> None:
    cluster, api = stack.cluster, stack.api
    doc = "".join(action(f"s{i}", "sleep", {"seconds": 0.3}) for i in range(3))
    jobs = []
    for _ in range(JOBS_UNDER_LOAD):
        response = submit(api, doc)
        assert response.status_code == 202, response.text
        jobs.append(response.json()["id"])
    harness.wait_until(lambda: job_status(api, jobs[0]) != "queued", timeout=60)

    killed = time.monotonic()
    old = cluster.kill_master()
    new = cluster.wait_failover(old)
    promoted = time.monotonic() - killed
    harness.wait_until(lambda: ready(api).status_code == 200, timeout=120, interval=0.2,
                       message=lambda: f"/readyz: {ready(api).text}")
    ready_again = time.monotonic() - killed
    for job_id in jobs:
        harness.wait_until(lambda j=job_id: job_status(api, j) in ("completed", "failed",
                                                                   "cancelled"),
                           timeout=180, interval=0.2)
    last_end = time.monotonic() - killed

    redriven: Counter[str] = Counter()
    for job_id in jobs:
        events = stack.store.events_after(job_id)
        assert job_status(api, job_id) == "completed", events
        assert events[-1]["type"] in TERMINAL_EVENTS
        assert terminal_events(events) == {"s0": 1, "s1": 1, "s2": 1}, (job_id, events)
        redriven.update(e["data"]["kind"] for e in events if e["type"] == "warning"
                        and e["data"].get("kind", "").endswith("_redriven"))
    print(f"\nsentinel failover, {JOBS_UNDER_LOAD} jobs x 3 actions: master {old} -> {new} "
          f"promoted after {promoted:.1f} s, /readyz 200 after {ready_again:.1f} s, last job "
          f"ended {last_end:.1f} s after the kill; reconciler re-sends: {dict(redriven)}")

    # The old master back on its address is a replica: Cortex follows the sentinels, not it.
    cluster.restart_as_replica(old)
    assert role(old) == "slave"
    response = submit(api, action("after", "echo", {"message": "still here"}))
    assert response.status_code == 202, response.text
    events = follow(api, response.json()["id"])
    assert events[-1]["type"] == "job_completed"
    assert all(w.alive for w in stack.workers.values())


def test_the_master_frozen_under_load(stack: SentinelStack) -> None:
    """A master that stops answering without closing its connections: the commands in flight
    on them (the store's, the workers' BRPOPs, the API's) must not wait for it for good."""
    cluster, api = stack.cluster, stack.api
    doc = "".join(action(f"s{i}", "sleep", {"seconds": 0.2}) for i in range(3))
    jobs = []
    for _ in range(JOBS_FROZEN):
        response = submit(api, doc)
        assert response.status_code == 202, response.text
        jobs.append(response.json()["id"])
    harness.wait_until(lambda: job_status(api, jobs[0]) != "queued", timeout=60)

    old = cluster.master_port()
    assert old is not None
    frozen = cluster.node(old).process
    assert frozen is not None
    frozen.kill(signal.SIGSTOP)
    stopped, stopped_at = time.monotonic(), time.time()
    try:
        new = cluster.wait_failover(old, timeout=120)
        promoted = time.monotonic() - stopped
        for job_id in jobs:
            harness.wait_until(lambda j=job_id: job_status(api, j) in ("completed", "failed",
                                                                       "cancelled"),
                               timeout=300, interval=0.2,
                               message=lambda j=job_id: f"job {j}: {job_status(api, j)}")
        seen_ended = time.monotonic() - stopped
        harness.wait_until(lambda: ready(api).status_code == 200, timeout=180, interval=0.2,
                           message=lambda: f"/readyz: {ready(api).text}")
        ready_again = time.monotonic() - stopped

        redriven: Counter[str] = Counter()
        ended_at = []
        for job_id in jobs:
            events = stack.store.events_after(job_id)
            assert job_status(api, job_id) == "completed", events
            assert [e["seq"] for e in events] == list(range(1, len(events) + 1)), (job_id, events)
            assert events[-1]["type"] in TERMINAL_EVENTS
            assert terminal_events(events) == {"s0": 1, "s1": 1, "s2": 1}, (job_id, events)
            ended_at.append(events[-1]["ts"])
            redriven.update(e["data"]["kind"] for e in events if e["type"] == "warning"
                            and e["data"].get("kind", "").endswith("_redriven"))
        print(f"\nsentinel, master frozen (SIGSTOP), {JOBS_FROZEN} jobs x 3 actions: master "
              f"{old} -> {new} promoted after {promoted:.1f} s; the last job ended "
              f"{max(ended_at) - stopped_at:.1f} s after the SIGSTOP (its log's last event; "
              f"the test saw every job ended after {seen_ended:.1f} s); /readyz 200 after "
              f"{ready_again:.1f} s; reconciler re-sends: {dict(redriven)}")
    finally:
        frozen.kill(signal.SIGCONT)
    # Woken, the old master is made a replica by the sentinels; the API's event streams read
    # a replica, so wait until it has synced before the next job.
    harness.wait_until(lambda: role(old) == "slave" and in_sync(old), timeout=120,
                       interval=0.2, message=lambda: f"{old} is {role(old)}, not a synced replica")
    response = submit(api, action("after", "echo", {"message": "still here"}))
    assert response.status_code == 202, response.text
    assert follow(api, response.json()["id"])[-1]["type"] == "job_completed"
    assert all(w.alive for w in stack.workers.values())


@pytest.fixture
def replica(tmp_path: Path) -> Iterator[harness.RedisServer]:
    """A plain Redis replica (of a master of its own): what a URL naming the old master
    reaches once the sentinels have made it a replica."""
    with harness.RedisServer(log_dir=tmp_path, data_dir=tmp_path / "master") as master:
        node = harness.RedisServer(log_dir=tmp_path, data_dir=tmp_path / "replica",
                                   extra_args=["--replicaof", harness.LOOPBACK, str(master.port)])
        with node:
            harness.wait_until(lambda: role(node.port) == "slave", timeout=10)
            yield node


def test_a_read_only_redis_is_a_503_that_says_so(cortex_env: dict[str, str],
                                                 replica: harness.RedisServer,
                                                 tmp_path: Path) -> None:
    env = {**cortex_env, "CORTEX_REDIS_URL": replica.url}
    with harness.api_running(env, log_dir=tmp_path, cwd=tmp_path) as api:
        response = submit(api, action("a", "echo", {"message": "hi"}))
        assert response.status_code == 503, response.text
        message = response.json()["detail"]["message"]
        assert message.startswith("Redis is read-only (a replica): "), message
        probe = ready(api)
        assert probe.status_code == 503
        assert probe.json()["redis"] is False
        assert probe.json()["error"] == (f"redis: Redis is read-only (a replica of "
                                         f"{harness.LOOPBACK}:{_master_port(replica)})")


def _master_port(replica: harness.RedisServer) -> int:
    client = replica.client(decode_responses=True)
    try:
        return int(client.info("replication")["master_port"])
    finally:
        client.close()


def test_a_worker_on_a_read_only_broker_exits_non_zero(cortex_env: dict[str, str],
                                                       replica: harness.RedisServer,
                                                       tmp_path: Path) -> None:
    env = {**cortex_env, "CORTEX_REDIS_URL": replica.url}
    worker = harness.start_worker("tool", env, concurrency=1, log_dir=tmp_path, cwd=tmp_path,
                                  wait=False)
    assert worker.wait_stopped(timeout=60), worker.describe(40)
    assert worker.returncode not in (0, None), worker.describe(40)
    assert "ReadOnlyError" in worker.log_text()


def test_a_worker_with_a_malformed_url_exits_2(cortex_env: dict[str, str]) -> None:
    env = {**cortex_env, "CORTEX_REDIS_URL": "redis+sentinel://127.0.0.1:26379,127.0.0.1:x/m/0"}
    out = harness.run_cortex(env, "worker", "--pool", "tool")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "sentinel '127.0.0.1:x' has a bad port 'x'" in out.stdout + out.stderr
