"""Scenario 2: the coordinator (the agent worker streaming a turn) is killed mid-turn.

The turn task is delivered again to another agent worker. `resume` sees the job `running`
with its plan open and a turn owner (`turn_owner`, host:pid) whose process is gone, and hands
the turn over: the same turn number and inbox. The new coordinator generates the turn again
(the fake model replays it: it is scripted twice); the action ids come out the same, and the
actions the dead coordinator had registered are not dispatched again. A `warning` with kind
`turn_restarted` tells clients that events of the turn may repeat."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

from tests import harness
from tests.chaos.conftest import TIMINGS, Stack
from tests.chaos.test_workers import of
from tests.fake_llm import Turn


def act(ident: str, name: str, params: dict[str, Any], mode: str = "async") -> str:
    body = json.dumps({"name": name, "parameters": params})
    return f'<action type="tool" mode="{mode}" id="{ident}">{body}</action>'


def kill_agent_worker(stack: Stack, spare: harness.Process, owner: str) -> float:
    """SIGKILL whichever of the two agent workers is `owner` (host:pid); the other one becomes
    the stack's agent worker. Returns when the kill was done."""
    victim = next(p for p in [stack.workers["agent"], spare]
                  if p.owns_pid(int(owner.rpartition(":")[2])))
    survivor = spare if victim is stack.workers["agent"] else stack.workers["agent"]
    victim.kill(signal.SIGKILL)
    assert victim.wait_stopped(10)
    killed_at = time.time()
    victim.stop()
    stack.workers["agent"] = survivor
    return killed_at


def test_coordinator_killed_mid_turn_resumes_elsewhere(stack: Stack) -> None:
    model = f"coord-kill-{os.urandom(4).hex()}"
    llm = stack.llm
    # Two actions written early, then a long thought: the coordinator dies while streaming it.
    text = ("<thought>Start both lookups now. "
            + act("a", "echo", {"message": "alpha"}) + act("b", "sleep", {"seconds": 0.3})
            + " Then think for a while. " + "Still thinking about the answer. " * 12
            + "</thought>" + act("c", "echo", {"message": "$a"}, mode="sync"))
    final = '<response final="true">Done: $a, $b, $c</response>'
    llm.script(model, [Turn(text=text, tokens_per_second=60, chunk_chars=8),  # killed midway
                       Turn(text=text, tokens_per_second=2000),               # the replay
                       Turn(text=final, tokens_per_second=2000)])
    spare = harness.start_worker("agent", stack.env, 4, log_dir=stack.dir, cwd=stack.dir)
    try:
        job_id = stack.submit({"agent": "tester", "input": "Look both up.",
                               "options": {"model": model}})
        stack.wait_event(job_id, lambda e: e["type"] == "action_completed"
                         and e["data"]["action_id"] == "b")
        owner = stack.client.hget(f"cx:{{{job_id}}}:job", "turn_owner")
        assert owner is not None
        killed_at = kill_agent_worker(stack, spare, owner)

        warning = stack.wait_event(job_id, lambda e: e["type"] == "warning"
                                   and e["data"].get("kind") == "turn_restarted", timeout=40)
        job = stack.wait_ended(job_id)
        events = stack.events(job_id)
    finally:
        if stack.workers["agent"] is not spare:
            spare.stop()
    assert job["status"] == "completed", (job, [e["type"] for e in events])
    assert job["result"] == 'Done: alpha, {"slept": 0.3}, alpha'
    # no action ran twice
    for ident in ("a", "b", "c"):
        assert [e["data"]["attempt"] for e in of(events, "action_started", ident)] == [1], ident
        assert len(of(events, "action_completed", ident)) == 1, ident
        assert len(of(events, "action_queued", ident)) == 1, ident
    assert {a["id"]: a["attempts"] for a in job["actions"]} == {"a": 1, "b": 1, "c": 1}
    assert warning["data"]["turn"] == 1
    assert [e["data"]["turn"] for e in of(events, "turn_started")] == [1, 2]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    new_owner = stack.client.hget(f"cx:{{{job_id}}}:job", "turn_owner")
    assert new_owner != owner
    assert llm.outcomes(model)[0] == "client_disconnected" or len(llm.requests(model)) == 3
    assert llm.remaining(model) == 0
    TIMINGS["coordinator killed mid-turn"] = {
        "kill -> turn taken over (s)": round(warning["ts"] - killed_at, 2),
        "kill -> job ended (s)": round(time.time() - killed_at, 2)}


def test_coordinator_killed_while_its_turn_waits_for_the_actions(stack: Stack) -> None:
    """The agent worker whose thread waits in place for the turn's action (`turn_wait_s`) is
    killed. Its pub/sub connection closed with it, so the action's end finds nobody on the
    waiter's channel and sends the next turn as a task, to the other agent worker, at once:
    no grace period, no redrive."""
    model = f"waiter-kill-{os.urandom(4).hex()}"
    llm = stack.llm
    llm.script(model, [
        Turn(text="<thought>Sleep.</thought>" + act("s", "sleep", {"seconds": 2.0}),
             tokens_per_second=2000),
        Turn(text='<response final="true">Slept $s.slept s.</response>', tokens_per_second=2000)])
    spare = harness.start_worker("agent", stack.env, 4, log_dir=stack.dir, cwd=stack.dir)
    try:
        job_id = stack.submit({"agent": "tester", "input": "Sleep.", "options": {"model": model}})
        waiter = harness.wait_until(
            lambda: stack.client.hget(f"cx:{{{job_id}}}:job", "turn_waiter"), timeout=20,
            message="the turn never waited in place for its action")
        killed_at = kill_agent_worker(stack, spare, waiter)
        job = stack.wait_ended(job_id)
        events = stack.events(job_id)
    finally:
        if stack.workers["agent"] is not spare:
            spare.stop()
    assert job["status"] == "completed", (job, [e["type"] for e in events])
    assert job["result"] == "Slept 2.0 s."
    assert not of(events, "warning"), of(events, "warning")
    (done,) = of(events, "action_completed", "s")
    second = next(e for e in events if e["type"] == "turn_started" and e["data"]["turn"] == 2)
    assert done["ts"] > killed_at
    assert second["ts"] - done["ts"] < 2.0  # sent by the action's worker, not by the reconciler
    assert llm.remaining(model) == 0
    TIMINGS["coordinator killed while its turn waits"] = {
        "action done -> next turn (s)": round(second["ts"] - done["ts"], 3)}
