"""Fair by tenant, with real workers: each tenant's messages go to its own lane of each pool's
queue (cortex_worker/actions/fairness.py), and a worker takes from its pool's lanes in turn
(kombu's Redis transport rotates the lane it just took from to the end of its BRPOP), so one
tenant's flood does not sit in front of another tenant's work; a tenant alone still gets the
whole pool; and a task sent again after its worker died stays in its tenant's lane.

The stack here is its own (Redis, an agent worker, a tool worker with 2 slots, an API with two
tenants' keys): the session's tool pool has 4 slots, and these tests kill a worker. Nothing is
asserted about durations: only the ORDER of timestamps the workers record (`action_started`,
`action_completed`, a job's last event), all taken on this machine's clock, and what waits in
the lanes at a moment the test holds still.

A backlog is built before the pool takes any of it, whatever the load: two jobs whose action
runs until the test releases it (`held`) fill the pool's two slots first. A worker whose slots
are all taken asks the broker for nothing (its prefetch is its 2 slots and it acknowledges a
message when the task ends, so kombu sends no `BRPOP` while 2 are unacknowledged): whatever is
submitted then waits, all of it, in the lanes, where the test counts it. The worker stays
alive and beating meanwhile (a SIGSTOPped one would hold a `BRPOP` in flight that takes one
message nobody records, and the reconciler would send that one again after its grace period).

That messages go to the tenant's lane is tested in-process in tests/engine/test_fairness.py."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from cortex_api.client import Client, JobOptions
from cortex_worker.pools import LANES, broker_lists, lanes
from cortex_worker.protocol.events import Event
from cortex_worker.store.keys import TENANT_LANES, job_keys
from tests import harness

TOOL_SLOTS = 2
KEYS = {"acme": "acme-" + secrets.token_urlsafe(24), "globex": "globex-" + secrets.token_urlsafe(24)}
TERMINAL = {"job_completed", "job_failed", "job_cancelled"}
FLOOD = 60  # acme's jobs
LIGHT = 2  # globex's
BACKGROUND = 30  # acme's background jobs, queued behind its urgent ones
SLEEP_S = 0.25  # each job: one `sleep` tool action
RELEASED = "released"  # the file, in a held job's workspace, that ends its action
SETTLE_S = 120.0  # a bound on waiting for a state that must come (not a measure of anything)


def sleeper(seconds: float, ident: str = "s") -> str:
    body = json.dumps({"name": "sleep", "parameters": {"seconds": seconds}})
    return f'<action type="tool" mode="async" id="{ident}">{body}</action><response>done</response>'


def held() -> str:
    """A document whose one tool action (a sandboxed python snippet, on the tool pool) runs
    until the test releases it (`Stack.release`): it holds a slot for as long as the test says,
    a state to wait for rather than an instant to catch."""
    code = ("import os, time\n"
            f"while not os.path.exists({RELEASED!r}):\n"
            "    time.sleep(0.02)\n"
            f"{RELEASED!r}\n")
    body = json.dumps({"name": "python", "parameters": {"code": code}})
    return f'<action type="tool" mode="async" id="h">{body}</action><response>done</response>'


@dataclass
class Stack:
    env: dict[str, str]
    url: str
    redis: redis.Redis
    log_dir: Path
    tool: harness.Process
    workspaces: Path  # CORTEX_WORKSPACE_ROOT: a job's workspace is <it>/<job id>
    held: list[str] = field(default_factory=list)  # `held` jobs not released yet

    def client(self, tenant: str) -> Client:
        return Client(self.url, api_key=KEYS[tenant])

    def lane_lengths(self, pool: str) -> dict[str, int]:
        """The messages waiting in each lane of `pool` that has any."""
        return {q: n for q in lanes(pool) if (n := int(self.redis.llen(q)))}

    def queued(self, pool: str) -> int:
        """The messages waiting in all of `pool`'s lanes, at every priority."""
        pipe = self.redis.pipeline(transaction=False)
        for name in broker_lists(pool):
            pipe.llen(name)
        return sum(pipe.execute())

    def logged(self, job: str) -> list[Event]:
        """The job's event log so far, read from its Redis stream (`follow` waits for its end)."""
        return [Event.model_validate_json(fields["e"])
                for _, fields in self.redis.xrange(job_keys(job).events)]

    def release(self, *jobs: str) -> None:
        """End the action of each `held` job: the file it waits for, in its workspace."""
        for job in jobs:
            workspace = self.workspaces / job
            workspace.mkdir(parents=True, exist_ok=True)
            (workspace / RELEASED).touch()


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
        running = Stack(env, api.url or "", client, log_dir, workers["tool"],
                        Path(env["CORTEX_WORKSPACE_ROOT"]).resolve())
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


def hold(stack: Stack, tenant: str, count: int) -> list[str]:
    """Submit `count` `held` jobs as `tenant`; the `released` fixture ends them all after the
    test, whatever happened."""
    jobs = submit_all(stack, tenant, held(), count)
    stack.held.extend(jobs)
    return jobs


@pytest.fixture(autouse=True)
def released(stack: Stack) -> Iterator[None]:
    """Every held job of the test released at its end, so that none holds a slot of the next."""
    try:
        yield
    finally:
        stack.release(*stack.held)
        stack.held.clear()


def wait_running(stack: Stack, jobs: list[str]) -> None:
    """Until each job's action has started (a held one then runs until released)."""
    def running() -> bool:
        return all(of(stack.logged(job), "action_started") for job in jobs)

    harness.wait_until(running, timeout=SETTLE_S, interval=0.05, message=lambda: (
        "not all running: " + ", ".join(f"{job}: {[e.type for e in stack.logged(job)]}"
                                        for job in jobs) + f"\n{stack.tool.describe()}"))


def wait_queued(stack: Stack, count: int) -> None:
    """Until `count` messages wait in the tool pool's lanes (at every priority). While held
    jobs fill the pool, nothing takes them: the count then only grows, to exactly `count`."""
    harness.wait_until(lambda: stack.queued("tool") >= count, timeout=SETTLE_S, interval=0.05,
                       message=lambda: f"{stack.queued('tool')} of {count} messages queued")
    assert stack.queued("tool") == count, stack.lane_lengths("tool")


def fill_pool(stack: Stack, tenant: str) -> list[str]:
    """Both slots of the tool pool taken by `tenant`'s held jobs, running: from now until they
    are released the worker takes nothing more (see the module's docstring)."""
    assert stack.queued("tool") == 0, stack.lane_lengths("tool")
    gates = hold(stack, tenant, TOOL_SLOTS)
    wait_running(stack, gates)
    return gates


def started(events: list[Event]) -> float:
    return of(events, "action_started")[0].ts


def completed(events: list[Event]) -> float:
    return of(events, "action_completed")[0].ts


def test_a_light_tenant_is_not_stuck_behind_another_tenants_flood(stack: Stack) -> None:
    """acme floods the 2-slot tool pool: 2 of its jobs run (held by the test) while its next 60
    wait; then globex submits 2. As slots free, globex's jobs go next, not after acme's backlog
    (which, FIFO, they did: issue 30, all 240 of acme's before globex's first)."""
    gates = fill_pool(stack, "acme")
    acme = submit_all(stack, "acme", sleeper(SLEEP_S), FLOOD, threads=4)
    globex = hold(stack, "globex", LIGHT)  # held too: the moment both run is a state
    wait_queued(stack, FLOOD + LIGHT)  # every one of them waits: none was taken

    lane = {t: int(stack.redis.hget(TENANT_LANES, t) or -1) for t in KEYS}
    assert 0 < lane["acme"] < LANES and 0 < lane["globex"] < LANES
    assert lane["acme"] != lane["globex"], lane
    acme_lane, globex_lane = lanes("tool")[lane["acme"]], lanes("tool")[lane["globex"]]
    assert stack.lane_lengths("tool") == {acme_lane: FLOOD, globex_lane: LIGHT}

    # The worker takes from the lanes in turn: each BRPOP lists them in its round-robin order
    # and the lane it took from goes to the end. acme's lane was the last taken from (the
    # gates), so as the gates end it takes globex's first job, then acme's first, then
    # globex's second: globex's second is taken once acme's first has ended (globex's first
    # holds the other slot). Then both slots hold globex's held jobs and the worker takes
    # nothing more: exactly FLOOD - 1 of acme's wait, and none of globex's. FIFO, globex's
    # would not have run before all 60 of acme's.
    stack.release(*gates)
    wait_running(stack, globex)
    waiting = stack.lane_lengths("tool")
    assert waiting == {acme_lane: FLOOD - 1}, (
        f"with globex's {LIGHT} jobs running, {waiting} wait (expected {FLOOD - 1} of acme's)")
    stack.release(*globex)

    logs = {job: follow(stack, "acme", job) for job in gates + acme}
    logs |= {job: follow(stack, "globex", job) for job in globex}
    for job, events in logs.items():
        assert events[-1].type == "job_completed", (job, events[-1])
    # the same, from the workers' own records: one of acme's started before globex's last,
    # and ended before it started (it freed the slot); the others started after both of
    # globex's had (each took a slot one of globex's had freed)
    globex_started = max(started(logs[job]) for job in globex)
    before = [job for job in acme if started(logs[job]) < globex_started]
    assert len(before) == 1, f"{len(before)} of acme's jobs started before globex's last"
    assert completed(logs[before[0]]) < globex_started, logs[before[0]]
    # the tool pool was full (both slots in use: globex's two ran at once) and never more
    assert most_at_once(list(logs.values())) == TOOL_SLOTS


def test_a_tenants_urgent_jobs_go_before_its_background_ones(
        stack: Stack) -> None:
    """acme queues 30 background jobs (priority 9), then 2 urgent ones (the default, 0): the
    urgent ones go next, before its queued background work. (That a priority orders only its
    tenant's own lane is the worker's lane-by-lane BRPOP: tests/unit/test_kombu_fixes.py.)"""
    gates = fill_pool(stack, "acme")
    background = submit_all(stack, "acme", sleeper(SLEEP_S), BACKGROUND, threads=3,
                            priority=9)
    urgent = hold(stack, "acme", 2)  # held: the moment both run is a state
    wait_queued(stack, BACKGROUND + len(urgent))  # every one of them waits: none was taken

    # One lane, acme's; each BRPOP lists its priorities in order (0 first), so as the gates
    # end the worker takes the two urgent jobs, one per freed slot, and then nothing more
    # while they run: all the background jobs still wait.
    stack.release(*gates)
    wait_running(stack, urgent)
    assert stack.queued("tool") == BACKGROUND, stack.lane_lengths("tool")
    stack.release(*urgent)

    logs = {job: follow(stack, "acme", job) for job in gates + background + urgent}
    assert all(events[-1].type == "job_completed" for events in logs.values())
    # the same, from the workers' own records: every background job started after both urgent
    # ones had (each took a slot an urgent one had freed)
    urgent_started = max(started(logs[job]) for job in urgent)
    overtook = [job for job in background if started(logs[job]) < urgent_started]
    assert not overtook, f"{len(overtook)} background jobs started before acme's urgent ones"


def test_a_tenant_alone_gets_the_whole_pool(stack: Stack) -> None:
    """acme's lane is one of 16, but with nobody else waiting it has both slots: two of its
    held jobs run at once (each runs until released, so both running is a state, not a
    moment), and a third waits in its lane until one of them ends."""
    assert stack.queued("tool") == 0, stack.lane_lengths("tool")
    both = hold(stack, "acme", TOOL_SLOTS)
    wait_running(stack, both)
    third = hold(stack, "acme", 1)
    wait_queued(stack, 1)
    assert not of(stack.logged(third[0]), "action_started")
    stack.release(*both, *third)
    logs = [follow(stack, "acme", job) for job in both + third]
    assert all(events[-1].type == "job_completed" for events in logs)
    assert started(logs[2]) > min(completed(logs[0]), completed(logs[1]))


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
