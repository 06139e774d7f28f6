"""Canvas dispatch: steps are `cortex.action` tasks, and a step whose action another delivery
holds waits for it without a worker slot (it retries itself) and without moving its chain on.

Both need real workers: a step's wait is a Celery retry with a countdown, held by a worker's
consumer (the stub broker has no retries: `task.retry` raises out of `join`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from cortex_api.client import Client
from cortex_api.models import JobOptions
from cortex_worker.protocol.events import Event
from cortex_worker.store.keys import job_keys
from cortex_worker.store.state import Store
from tests import harness
from tests.integration.test_documents import action

WAITING = "a"  # the action whose lease the tests hold from outside
HOLDER = "elsewhere:1"  # ... as this worker process of another host


@pytest.fixture
def client(workers: Any, api: Any) -> Iterator[Client]:  # the pools must run
    with Client(api.url) as cortex:
        yield cortex


def start(client: Client, protocol: str, *, canvas: bool) -> str:
    return client.submit_document(protocol, options=JobOptions(canvas=canvas)).id


def status_of(client: Client, job_id: str, action_id: str) -> str | None:
    return next((a.status for a in client.get_job(job_id).actions if a.id == action_id), None)


def follow(client: Client, job_id: str) -> list[Event]:
    """The job's whole event log, read until its last event."""
    return list(client.events(job_id, timeout=60))


def of(events: list[Event], kind: str, action_id: str | None = None) -> list[Event]:
    return [e for e in events if e.type == kind
            and (action_id is None or e.data.get("action_id") == action_id)]


def one(events: list[Event], kind: str, action_id: str | None = None) -> Event:
    found = of(events, kind, action_id)
    assert len(found) == 1, (kind, action_id, [e.type for e in events])
    return found[0]


def waiting_steps(control: Any) -> tuple[set[str], set[str]]:
    """(ids of tasks waiting for their ETA, ids of tasks running) on every worker."""
    inspect = control.control.inspect(timeout=0.5)
    scheduled = {s["request"]["id"] for tasks in (inspect.scheduled() or {}).values()
                 for s in tasks}
    active = {t["id"] for tasks in (inspect.active() or {}).values() for t in tasks}
    return scheduled, active


def hold(client: redis.Redis, job_id: str, until: float) -> None:
    """Give `WAITING`'s lease to `HOLDER` until `until` (epoch seconds)."""
    client.hset(job_keys(job_id).lease, WAITING, f"{HOLDER}|{until!r}")


def started_once(events: list[Event], *action_ids: str) -> dict[str, float]:
    """Each action started exactly once: when (from the event log)."""
    return {a: one(events, "action_started", a).ts for a in action_ids}


def test_busy_canvas_step_waits_without_a_worker_slot(client: Client, redis_client: redis.Redis,
                                                      cortex_env: dict[str, str]) -> None:
    doc = (action("s", "sleep", {"seconds": 0.3})
           + action(WAITING, "echo", {"message": "$s"}, depends_on=["s"])
           + action("b", "echo", {"message": "$a"}, depends_on=[WAITING]))
    job_id = start(client, doc, canvas=True)
    harness.wait_until(lambda: status_of(client, job_id, "s") == "running", timeout=20,
                       interval=0.02)
    # Another delivery holds `a`: a live lease of a worker on another host, whose heartbeat is
    # live too (a holder without one is taken over at once). It is held until the rest of
    # the test has looked (not for a fixed time: a loaded machine may take seconds to get
    # there), then let go.
    Store(redis_client).beat(HOLDER, 120.0)
    hold(redis_client, job_id, time.time() + 120.0)

    # The step for `a` arrives when `s` ends, finds the lease live, and waits as a retry with
    # an ETA (held by the worker's consumer), not in a pool process.
    control = harness.celery_control_app(cortex_env)
    step = f"{job_id}:{WAITING}"
    harness.wait_until(lambda: step in waiting_steps(control)[0], timeout=10, interval=0.05)
    assert step not in waiting_steps(control)[1]

    # Meanwhile every slot of the tool pool (4) is free: four sleeps all run at once. (1.5 s
    # each: with 0.5 s, one clean-clone run on a busy 2-core machine started the last sleep
    # 0.1 s after the first had ended; a pool process's first call of a tool also starts
    # that tool's runner, which may be the cause.)
    wide = "".join(action(f"p{i}", "sleep", {"seconds": 1.5}) for i in range(4))
    wide_id = start(client, wide, canvas=False)
    wide_events = follow(client, wide_id)
    assert wide_events[-1].type == "job_completed"
    starts = started_once(wide_events, *[f"p{i}" for i in range(4)])
    ends = [e.ts for e in of(wide_events, "action_completed")]
    assert max(starts.values()) < min(ends), (starts, ends)
    assert status_of(client, job_id, WAITING) != "running"  # all of it while `a` still waited

    until = time.time() + 0.5  # the other holder lets go
    hold(redis_client, job_id, until)

    events = follow(client, job_id)
    assert events[-1].type == "job_completed"
    assert len(of(events, "job_completed")) == 1
    started = started_once(events, "s", WAITING, "b")
    assert started[WAITING] >= until  # it ran once the other holder's lease had ended
    assert one(events, "action_started", WAITING).data["attempt"] == 1
    # the chain did not move on before `a` had ended
    assert started["b"] >= one(events, "action_completed", WAITING).ts
    assert one(events, "action_completed", "b").data["status"] == "ok"


def test_duplicate_canvas_step_runs_its_action_once(client: Client,
                                                    cortex_env: dict[str, str]) -> None:
    doc = (action(WAITING, "sleep", {"seconds": 1.0})
           + action("b", "echo", {"message": "after"}, depends_on=[WAITING]))
    job_id = start(client, doc, canvas=True)
    harness.wait_until(lambda: status_of(client, job_id, WAITING) == "running", timeout=20,
                       interval=0.02)
    # Deliver the rest of the chain again while `a` runs (as the broker does after a lost
    # connection): the copy of `a` finds it held, waits, then finds it done and passes on.
    control = harness.celery_control_app(cortex_env)
    copy = (control.signature("cortex.action", args=[job_id, WAITING], immutable=True,
                              queue="tool", task_id=f"{job_id}:{WAITING}", reply_to="")
            | control.signature("cortex.action", args=[job_id, "b"], immutable=True,
                                queue="tool", task_id=f"{job_id}:b", reply_to=""))
    copy.apply_async()
    step = f"{job_id}:{WAITING}"
    harness.wait_until(lambda: step in waiting_steps(control)[0], timeout=10, interval=0.05)

    events = follow(client, job_id)
    assert events[-1].type == "job_completed"
    # The copy comes back when its look-again delay (at most 5 s) has passed, finds `a`
    # recorded and sends its copy of `b`, which finds `b` recorded too.
    harness.wait_until(lambda: not ({step, f"{job_id}:b"} & set().union(*waiting_steps(control))),
                       timeout=15, interval=0.2)
    time.sleep(0.5)  # a re-run would log action_started within milliseconds
    later = follow(client, job_id)
    assert len(of(later, "action_started")) == 2
    assert len(of(later, "job_completed")) == 1
    job = client.get_job(job_id)
    assert job.status == "completed"
    assert [a.attempts for a in job.actions] == [1, 1]
