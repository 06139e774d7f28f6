"""Recovery from Cortex's own state, with the settings as shipped (cortex_worker/recovery/reconciler.py).

Each test loses work the way a dying process or kombu's pop-then-record gap loses it: the
broker message of a start or of a queued action is dropped from its queue while no worker of
that pool runs. Nothing but the reconciler (in the remaining workers) can bring it back: the
broker's visibility timeout is 6 hours.
"""

from __future__ import annotations

import json
import time
from typing import Any

from tests import harness
from tests.chaos.conftest import TIMINGS, Stack
from tests.chaos.test_workers import of, started, tool

RECOVERY_S = 30.0  # the bound: lost work runs again within 30 s


def warnings(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in of(events, "warning") if e["data"].get("kind") == kind]


def drop_queue(stack: Stack, queue: str) -> int:
    """Lose every message waiting in a broker queue (as a worker killed between kombu's
    BRPOP and its unacked bookkeeping loses one); returns how many there were."""
    pipe = stack.client.pipeline()
    pipe.llen(queue)
    pipe.delete(queue)
    return int(pipe.execute()[0])


def lose_first_message(stack: Stack, doc: str, canvas: bool) -> tuple[str, float]:
    """Submit `doc` while no tool worker runs, drop the one message it sends to the tool
    queue (a chain holds every later step), and start a tool worker again."""
    stack.kill_worker("tool")
    try:
        job_id = stack.submit({"protocol": doc, "options": {"canvas": canvas}})
        stack.wait_event(job_id, lambda e: e["type"] == "action_queued")
        expected = "canvas" if canvas else "readiness"
        assert stack.client.hget(f"cx:{{{job_id}}}:job", "dispatch") == expected
        # `action_queued` is logged before the message is published: wait for it
        harness.wait_until(lambda: stack.client.llen("tool") >= 1, timeout=10,
                           message="no message reached the tool queue")
        assert drop_queue(stack, "tool") == 1
        return job_id, time.time()
    finally:
        stack.replace_worker("tool")


def completed(stack: Stack, job_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    job = stack.wait_ended(job_id, timeout=RECOVERY_S + 20)
    events = stack.events(job_id)
    assert job["status"] == "completed", [e["type"] for e in events]
    return job, events


def test_a_lost_queued_action_is_sent_again(stack: Stack) -> None:
    doc = (tool("a", "echo", {"message": "first"})
           + tool("b", "echo", {"message": "$a"}, depends_on=["a"])
           + "<response>$b</response>")
    job_id, lost_at = lose_first_message(stack, doc, canvas=False)
    _, events = completed(stack, job_id)
    again = warnings(events, "action_redriven")
    assert [w["data"]["action_id"] for w in again] == ["a"]
    assert "no worker took it" in again[0]["data"]["message"]
    assert of(events, "action_started", "a")[0]["ts"] - lost_at < RECOVERY_S
    assert len(of(events, "action_started", "a")) == len(of(events, "action_completed", "a")) == 1
    TIMINGS["queued action lost"] = {
        "lost -> started again (s)": round(of(events, "action_started", "a")[0]["ts"] - lost_at, 2)}


def test_a_lost_canvas_step_runs_by_readiness(stack: Stack) -> None:
    doc = (tool("a", "echo", {"message": "one"})
           + tool("b", "echo", {"message": "$a"}, depends_on=["a"])
           + tool("c", "echo", {"message": "$b"}, depends_on=["b"])
           + "<response>$c</response>")
    job_id, _ = lose_first_message(stack, doc, canvas=True)  # the chain: a, then b, then c
    job, events = completed(stack, job_id)
    assert job["result"] == "one"
    for action in "abc":
        assert len(of(events, "action_completed", action)) == 1


def test_a_lost_start_is_sent_again(stack: Stack) -> None:
    stack.kill_worker("agent")
    try:
        job_id = stack.submit({"protocol": tool("x", "echo", {"message": "hi"})
                               + "<response>$x</response>"})
        time.sleep(0.5)
        assert drop_queue(stack, "agent") == 1  # its `cortex.start_job`
    finally:
        stack.replace_worker("agent")
    _, events = completed(stack, job_id)
    assert len(warnings(events, "start_redriven")) == 1
    assert len(of(events, "job_started")) == 1


def test_a_long_action_on_a_healthy_worker_starts_once(stack: Stack) -> None:
    """Longer than the liveness TTL, the grace period and several reconciler passes."""
    job_id = stack.submit({"protocol": tool("long", "sleep", {"seconds": 25})
                           + "<response>$long</response>"})
    job = stack.wait_ended(job_id, timeout=60)
    events = stack.events(job_id)
    assert job["status"] == "completed"
    assert len(of(events, "action_started", "long")) == 1
    assert of(events, "warning") == []
    assert json.loads(json.dumps(job["last_progress_at"])) >= of(events, "job_completed")[0]["ts"] - 1


def test_a_job_shows_when_it_last_made_progress(stack: Stack) -> None:
    job_id = stack.submit({"protocol": tool("s", "sleep", {"seconds": 1.5})
                           + "<response>$s</response>"})
    stack.wait_event(job_id, started("s"))
    during = stack.job(job_id)
    assert during["status"] == "running"
    assert abs(during["last_progress_at"] - stack.events(job_id)[-1]["ts"]) < 0.01
    stack.wait_ended(job_id)
