"""Fair by tenant, with real workers: each tenant's messages go to its own lane of each pool's
queue (cortex_worker/actions/fairness.py), and a worker takes from its pool's lanes in turn
(kombu's Redis transport rotates the lane it just took from to the end of its BRPOP), so one
tenant's flood does not sit in front of another tenant's work; a tenant alone still gets the
whole pool; and a task sent again after its worker died stays in its tenant's lane.

The stack here is its own (Redis, an agent worker, a tool worker with 2 slots, an API with two
tenants' keys): the session's tool pool has 4 slots, and these tests kill a worker. Nothing is
asserted about durations: only the ORDER of timestamps the workers record (`action_started`,
`action_completed`, a job's last event), all taken on this machine's clock.

That messages go to the tenant's lane is tested in-process in tests/engine/test_fairness.py."""

from __future__ import annotations

import itertools
import json
import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from cortex_api.client import Client, JobOptions
from cortex_worker.pools import LANES, lanes
from cortex_worker.protocol.events import Event
from cortex_worker.store.keys import TENANT_LANES
from tests import harness

TOOL_SLOTS = 2
KEYS = {"acme": "acme-" + secrets.token_urlsafe(24), "globex": "globex-" + secrets.token_urlsafe(24)}
TERMINAL = {"job_completed", "job_failed", "job_cancelled"}
FLOOD = 60  # acme's jobs
LIGHT = 2  # globex's
SLEEP_S = 0.25  # each job: one `sleep` tool action


def sleeper(seconds: float, ident: str = "s") -> str:
    body = json.dumps({"name": "sleep", "parameters": {"seconds": seconds}})
    return f'<action type="tool" mode="async" id="{ident}">{body}</action><response>done</response>'


@dataclass
class Stack:
    env: dict[str, str]
    url: str
    redis: redis.Redis
    log_dir: Path
    tool: harness.Process

    def client(self, tenant: str) -> Client:
        return Client(self.url, api_key=KEYS[tenant])

    def lane_lengths(self, pool: str) -> dict[str, int]:
        """The messages waiting in each lane of `pool` that has any."""
        return {q: n for q in lanes(pool) if (n := int(self.redis.llen(q)))}


@pytest.fixture(scope="module")
def stack(cortex_env: dict[str, str], harness_dir: Path) -> Iterator[Stack]:
    log_dir = harness_dir / "fairness"
    with harness.RedisServer(log_dir=log_dir, data_dir=log_dir / "redis") as server:
        env = {**cortex_env, "CORTEX_REDIS_URL": server.url,
               "CORTEX_API_KEYS": ",".join(f"{t}:{k}" for t, k in KEYS.items())}
        workers = harness.start_workers({"agent": 2, "tool": TOOL_SLOTS}, env, log_dir=log_dir,
                                        cwd=log_dir)
        api = harness.start_api(env, log_dir=log_dir, cwd=log_dir)
        client = server.client(decode_responses=True)
        running = Stack(env, api.url or "", client, log_dir, workers["tool"])
        try:
            yield running
        finally:
            client.close()
            harness.stop_all(processes=[api, *workers.values(), running.tool])


def follow(stack: Stack, tenant: str, job_id: str, timeout: float = 60) -> list[Event]:
    """The job's whole event log, over HTTP as its tenant, until its last event."""
    with stack.client(tenant) as client:
        return list(client.events(job_id, timeout=timeout))


def of(events: list[Event], kind: str) -> list[Event]:
    return [e for e in events if e.type == kind]


def submit_all(stack: Stack, tenant: str, protocol: str, count: int, threads: int = 1,
               priority: int = 0) -> list[str]:
    """Submit `count` copies of `protocol` as `tenant` (at `priority`), from `threads` clients
    at once."""
    options = JobOptions(priority=priority)

    def batch(n: int) -> list[str]:
        with stack.client(tenant) as client:
            return [client.submit_document(protocol, options=options).id for _ in range(n)]

    sizes = [count // threads + (i < count % threads) for i in range(threads)]
    with ThreadPoolExecutor(threads) as pool:
        return [job for ids in pool.map(batch, sizes) for job in ids]


def most_at_once(logs: list[list[Event]]) -> int:
    """The most actions running at one moment, from their start and end events (an end
    before a start at the same instant)."""
    edges = sorted((e.ts, 1 if e.type == "action_started" else -1) for events in logs
                   for e in events if e.type in ("action_started", "action_completed"))
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


def test_a_light_tenant_is_not_stuck_behind_another_tenants_flood(stack: Stack) -> None:
    """acme floods the 2-slot tool pool with 60 jobs, then globex submits 2: globex's jobs go
    next, not after acme's backlog (which, FIFO, they did: issue 30, all 240 of acme's before
    globex's first)."""
    acme = submit_all(stack, "acme", sleeper(SLEEP_S), FLOOD, threads=4)
    backlog = sum(stack.lane_lengths("tool").values())  # a look, for the message below
    globex = submit_all(stack, "globex", sleeper(SLEEP_S), LIGHT)
    logs = {job: follow(stack, "acme", job) for job in acme}
    logs |= {job: follow(stack, "globex", job) for job in globex}
    for job, events in logs.items():
        assert events[-1].type == "job_completed", (job, events[-1])

    lane = {t: int(stack.redis.hget(TENANT_LANES, t) or -1) for t in KEYS}
    assert 0 < lane["acme"] < LANES and 0 < lane["globex"] < LANES
    assert lane["acme"] != lane["globex"], lane

    def ended(job: str) -> float:
        return logs[job][-1].ts

    def started(job: str) -> float:
        return of(logs[job], "action_started")[0].ts

    globex_queued = min(of(logs[job], "job_queued")[0].ts for job in globex)
    globex_done = max(ended(job) for job in globex)
    # acme's jobs still waiting for a slot when globex arrived: the flood really queued up
    waiting = [job for job in acme if started(job) > globex_queued]
    assert len(waiting) >= FLOOD // 2, (
        f"only {len(waiting)} of acme's {FLOOD} jobs were still waiting when globex submitted "
        f"(tool lanes then: {backlog} messages): the flood did not queue up")
    # of those, only the few taken in turn with globex's (2 slots, one lane after the other)
    # ended before globex's last job did; FIFO, all of them would have
    overtook = [job for job in waiting if ended(job) < globex_done]
    assert len(overtook) <= 2 * TOOL_SLOTS, (
        f"{len(overtook)} of acme's {len(waiting)} waiting jobs ended before globex's last")
    behind = [job for job in acme if ended(job) > globex_done]
    assert len(behind) > 40, f"only {len(behind)} of acme's {FLOOD} jobs ended after globex's"
    # the tool pool stayed full all along: fairness costs no slot
    assert most_at_once(list(logs.values())) == TOOL_SLOTS


def test_a_tenants_urgent_jobs_go_before_its_background_ones(
        stack: Stack) -> None:
    """acme queues 30 background jobs (priority 9), then 2 urgent ones (the default, 0): the
    urgent ones go next, before its queued background work. (That a priority orders only its
    tenant's own lane is the worker's lane-by-lane BRPOP: tests/unit/test_kombu_fixes.py.)"""
    background = submit_all(stack, "acme", sleeper(SLEEP_S), 30, threads=3, priority=9)
    urgent = submit_all(stack, "acme", sleeper(SLEEP_S), 2)
    logs = {job: follow(stack, "acme", job) for job in background + urgent}
    assert all(events[-1].type == "job_completed" for events in logs.values())

    def started(events: list[Event]) -> float:
        return of(events, "action_started")[0].ts

    urgent_queued = min(of(logs[job], "job_queued")[0].ts for job in urgent)
    urgent_started = max(started(logs[job]) for job in urgent)
    waiting = [job for job in background if started(logs[job]) > urgent_queued]
    assert len(waiting) >= 15, f"only {len(waiting)} background jobs were still queued"
    overtook = [job for job in waiting if started(logs[job]) < urgent_started]
    assert len(overtook) <= 2 * TOOL_SLOTS, (
        f"{len(overtook)} of acme's {len(waiting)} queued background jobs started before its "
        "urgent ones")


def test_a_tenant_alone_gets_the_whole_pool(stack: Stack) -> None:
    """acme's lane is one of 16, but with nobody else waiting it has both slots: its actions
    run two at a time."""
    acme = submit_all(stack, "acme", sleeper(1.0), 4)
    logs = [follow(stack, "acme", job) for job in acme]
    assert all(events[-1].type == "job_completed" for events in logs)
    assert most_at_once(logs) == TOOL_SLOTS
    # two jobs' actions overlap: one started before the other had ended
    spans = sorted((of(events, "action_started")[0].ts, of(events, "action_completed")[0].ts)
                   for events in logs)
    assert any(later[0] < earlier[1] for earlier, later in itertools.pairwise(spans))


def test_a_task_sent_again_after_its_worker_died_stays_in_its_tenants_lane(
        stack: Stack) -> None:
    """The tool worker is killed in the middle of acme's action; the reconciler sends it
    again, to acme's lane (where it waits while no tool worker runs), and a new worker runs
    it to the end."""
    lane = lanes("tool")[int(stack.redis.hget(TENANT_LANES, "acme") or -1)]
    seen: list[Event] = []
    with stack.client("acme") as client:
        job = client.submit_document(sleeper(3.0)).id
        stream = iter(client.events(job, timeout=60))

        def until(kind: str, what: str = "") -> Event:
            for event in stream:
                seen.append(event)
                if event.type == kind and event.data.get("kind", "") == what:
                    return event
            raise AssertionError(f"no {kind} {what} in {[e.type for e in seen]}")

        until("action_started")
        stack.tool.kill()
        assert stack.tool.wait_stopped(10), stack.tool.describe()
        stack.tool.stop()
        redriven = until("warning", "action_redriven")
        assert "stopped; it was sent again" in redriven.data["message"]
        waiting = harness.wait_until(lambda: stack.lane_lengths("tool"), timeout=10)
        assert waiting == {lane: 1}, waiting
        stack.tool = harness.start_worker("tool", stack.env, TOOL_SLOTS,
                                          log_dir=stack.log_dir, cwd=stack.log_dir)
        seen.extend(stream)
    assert seen[-1].type == "job_completed", seen[-1]
    assert [e.data["attempt"] for e in of(seen, "action_started")] == [1, 2]
    assert len(of(seen, "action_completed")) == 1
