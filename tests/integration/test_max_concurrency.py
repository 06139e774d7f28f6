"""`max_concurrency`: at most that many calls of a tool run at once across the cluster; the
others wait without holding a worker slot, so other work goes on (real workers, real Redis).

These need calls that really run at once, in several worker processes; the slots' protocol
(a call in line, a second delivery) is tested in-process in tests/engine/test_max_concurrency.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from cortex_api.client import Client
from cortex_api.models import JobOptions
from cortex_worker.protocol.events import Event

LIMIT = 2  # tests/manifests/tools.yaml: rate_limited


def calls(count: int, seconds: float) -> str:
    body = json.dumps({"name": "rate_limited", "parameters": {"seconds": seconds}})
    return "".join(f'<action type="tool" mode="async" id="r{i}">{body}</action>'
                   for i in range(count)) + "<response>done</response>"


@pytest.fixture
def client(workers: Any, api: Any) -> Iterator[Client]:  # the pools must run
    with Client(api.url) as cortex:
        yield cortex


def of(events: list[Event], kind: str, action_id: str | None = None) -> list[Event]:
    return [e for e in events if e.type == kind
            and (action_id is None or e.data.get("action_id") == action_id)]


def follow(client: Client, job_id: str, timeout: float = 60) -> list[Event]:
    """The job's whole event log, read until its last event."""
    return list(client.events(job_id, timeout=timeout))


def most_at_once(events: list[Event]) -> int:
    """The most actions running at the same moment, from their start and end events."""
    edges = sorted([(e.ts, 1) for e in of(events, "action_started")]
                   + [(e.ts, -1) for e in of(events, "action_completed")],
                   key=lambda edge: (edge[0], edge[1]))
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


def started_job(client: Client, protocol: str, **options: Any) -> str:
    return client.submit_document(protocol, options=JobOptions(**options)).id


@pytest.mark.parametrize("canvas", [False, True])
def test_a_tool_never_runs_more_than_its_max_concurrency(client: Client, canvas: bool) -> None:
    job_id = started_job(client, calls(8, 0.3), canvas=canvas, max_parallel=100)
    events = follow(client, job_id)
    assert events[-1].type == "job_completed", [e.type for e in events]
    assert most_at_once(events) <= LIMIT
    for i in range(8):  # each ran once: a call that waited logged nothing until it ran
        assert len(of(events, "action_started", f"r{i}")) == 1
        assert len(of(events, "action_completed", f"r{i}")) == 1
    assert not [w for w in of(events, "warning") if w.data.get("kind") == "action_redriven"]


def test_waiting_calls_hold_no_worker_slot(client: Client) -> None:
    """16 calls wait for 2 slots of a 4-slot tool pool; another job's actions run meanwhile."""
    limited = started_job(client, calls(16, 0.25), canvas=False, max_parallel=100)
    other = started_job(client, "".join(
        f'<action type="tool" mode="async" id="e{i}">{{"name": "echo", "parameters": '
        f'{{"message": {i}}}}}</action>' for i in range(6)) + "<response>ok</response>")
    other_events = follow(client, other)
    limited_events = follow(client, limited)
    assert other_events[-1].type == "job_completed"
    assert limited_events[-1].type == "job_completed"
    assert most_at_once(limited_events) <= LIMIT
    # the other job finished while the limited one still had calls waiting (≈ 2 s in all)
    assert other_events[-1].ts < of(limited_events, "action_started")[-1].ts


def test_a_fan_out_of_500_calls_keeps_the_limit_and_starves_no_other_job(
        client: Client) -> None:
    """What a model fanning out 500 calls of a rate-limited API does: at most LIMIT run at
    once, each runs once, and another job's actions are not stuck behind them."""
    limited = started_job(client, calls(500, 0), canvas=False, max_parallel=500)
    other = started_job(client, "".join(
        f'<action type="tool" mode="async" id="e{i}">{{"name": "echo", "parameters": '
        f'{{"message": {i}}}}}</action>' for i in range(6)) + "<response>ok</response>")
    other_events = follow(client, other)
    limited_events = follow(client, limited, timeout=180)
    assert other_events[-1].type == "job_completed"
    assert limited_events[-1].type == "job_completed", limited_events[-1]
    assert most_at_once(limited_events) <= LIMIT
    started = of(limited_events, "action_started")
    assert sorted(e.data["action_id"] for e in started) == sorted(f"r{i}" for i in range(500))
    assert other_events[-1].ts < started[-1].ts  # done long before the fan-out was
