"""Issue 31: a worker process that only *looks* dead, then wakes up, changes nothing.

A worker stopped with SIGSTOP (as a long GC pause, a frozen VM or a network partition would
stop it) stops beating, so after `liveness_ttl_s` (10 s as shipped) Cortex judges it dead and
gives its work to another process: the reconciler sends its running action again (attempt 2),
or the turn it coordinated is taken over (`turn_restarted`). Unlike a killed worker, a paused
one wakes up (SIGCONT) still believing it holds its lease, with its stream's bytes and its
buffered chunks waiting. Fencing (cortex_worker/recovery/fencing.py, lua/prelude.lua) is what
keeps it from writing: each write carries the holder's number (an action's attempt, a turn's
`turn_fence`) and the store refuses a stale one in the same call, logs it in the holder's
worker ("stale write dropped", or "turn fence N is stale") and counts it
(`cortex_stale_writes_total`); a tool worker's heartbeat also stops a stale attempt ("attempt
N of action X is stale ... stopping it").

These tests pause real worker processes of the chaos stack, with the settings as shipped, and
check what was recorded, never how long anything took: which attempt's result the job holds,
that each action and the job end once, that the log's seqs run 1..n, and that a client
joining the taken-over turn's chunks reads the regenerated text and nothing of the stale one.
A test learns that a woken worker has finished acting by asking it (Celery's `inspect active`
shows no task), not by waiting some time. Every paused process is woken in a `finally`
(`paused`): a stopped process holds SIGTERM, which would hold up the stack's teardown.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests import harness
from tests.chaos.conftest import Stack, paused
from tests.chaos.test_coordinator import act
from tests.chaos.test_workers import of, started, tool
from tests.fake_llm import Turn

#: The warnings a woken tool worker logs for its stale attempt: its result refused by the
#: store, or the heartbeat's fencing check stopping it (whichever came first; often both).
TOOL_STALE = re.compile(r"stale write dropped|attempt \d+ of action \S+ is stale .*stopping it")
#: The warnings a woken coordinator logs when a write of its turn is refused.
TURN_STALE = re.compile(r"stale write dropped|turn fence \d+ is stale")
#: How long a woken worker may take to finish what it was doing (a bound, never an assertion
#: on time: a loaded machine takes long, a correct one always gets there).
SETTLE_S = 90.0
#: How long attempt 1 of the paused tool worker's action sleeps: less than any pause the
#: reconciler acts on (liveness_ttl_s, 10 s), or far longer than the test.
ENDS_IN_THE_PAUSE, NEVER_ENDS = 3, 3600


def snippet(first: float, later: float) -> str:
    """A python tool call that sleeps `first` seconds on attempt 1 and `later` on any other,
    and returns its attempt (CORTEX_ATTEMPT): the recorded value says which attempt won."""
    return ("import os, time\n"
            "attempt = int(os.environ['CORTEX_ATTEMPT'])\n"
            f"time.sleep({first} if attempt == 1 else {later})\n"
            "attempt\n")


def attempt_processes(job_id: str, attempt: int) -> list[int]:
    """The live processes of this machine that run `attempt` of a tool call of `job_id`: a
    sandboxed tool is given CORTEX_JOB_ID and CORTEX_ATTEMPT in its environment (see
    cortex_worker/tools/attempt.py), which /proc shows (a zombie's environment reads empty),
    as `ps e` does: for a call forked from a warm runner too, as the python built-in's are
    (cortex_worker/sandbox/zygote.py shows the call's environment there, not the zygote's)."""
    want = {f"CORTEX_JOB_ID={job_id}".encode(), f"CORTEX_ATTEMPT={attempt}".encode()}
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = set((entry / "environ").read_bytes().split(b"\0"))
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if want <= environ:
            found.append(int(entry.name))
    return found


def pid_of(owner: str) -> int:
    """The pid of a lease holder `host:pid`."""
    return int(owner.rpartition(":")[2])


def wait_idle(stack: Stack, proc: harness.Process) -> None:
    """Until `proc` answers Celery's remote control with no task running: a woken worker has
    then finished the task it was paused in (its writes made or refused), so a later look at
    the job shows everything it will ever do to it."""
    harness.wait_until(lambda: stack.active_tasks(proc) == [], timeout=SETTLE_S, interval=0.25,
                       message=lambda: f"the woken worker never went idle:\n{proc.describe(60)}")


def hand_over(stack: Stack, pool: str, woken: harness.Process,
              spare: harness.Process | None) -> None:
    """Leave the stack with one worker for `pool`: the spare started during the test (the
    woken one is stopped) or, if none was started, the woken one."""
    if spare is None:
        return
    stack.workers[pool] = spare
    woken.stop()


def result_record(stack: Stack, job_id: str, action_id: str) -> dict[str, Any]:
    """The action's result record as `finish` stored it (the API does not show `attempt`)."""
    raw = stack.client.hget(f"cx:{{{job_id}}}:result", action_id)
    assert raw is not None, f"no result recorded for {action_id}"
    return json.loads(raw)


def terminal(events: list[dict[str, Any]], action: str) -> list[dict[str, Any]]:
    """The action's end events (completed, failed, skipped)."""
    return [e for e in events if e["type"] in ("action_completed", "action_failed",
                                                "action_skipped")
            and e["data"].get("action_id") == action]


def check_log_shape(events: list[dict[str, Any]]) -> None:
    """Each seq once, 1..n, and the job ended once, as the log's last event."""
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1)), \
        [(e["seq"], e["type"]) for e in events]
    ends = [e for e in events if e["type"] in ("job_completed", "job_failed", "job_cancelled")]
    assert [e["type"] for e in ends] == ["job_completed"], [e["type"] for e in events]
    assert events[-1] is ends[0], [e["type"] for e in events]


def total(metric: dict[str, float]) -> float:
    """Stale writes of every kind: which write a woken process tries first is its own affair."""
    return sum(metric.values())


# ------------------------------------------------------------------------------ tool workers


@pytest.mark.parametrize("first", [ENDS_IN_THE_PAUSE, NEVER_ENDS],
                         ids=["ended-in-the-pause", "running-when-woken"])
def test_tool_worker_woken_after_its_action_ran_again(stack: Stack, first: int) -> None:
    """The paused worker's attempt 1 (a sandboxed python tool call, whose process is in a
    session of its own and is not paused with the worker) is sent again by the reconciler to
    another worker (attempt 2), and the paused worker is woken while attempt 2 runs.

    `ended-in-the-pause`, the issue's case: attempt 1's process ended during the pause, so the
    woken worker has its result to record at once, while attempt 2 still runs (as a rule): it
    must be refused. `running-when-woken`:
    attempt 1 would sleep an hour; the woken worker's heartbeat must find it stale and kill
    its process (the worker can go idle no other way). Either way the job holds attempt 2's
    result alone."""
    doc = (tool("slow", "python", {"code": snippet(first=first, later=8)})
           + "<response>$slow.result</response>")
    worker = stack.workers["tool"]
    job_id = stack.submit({"protocol": doc})
    one = stack.wait_event(job_id, started("slow", 1))
    assert worker.owns_pid(pid_of(one["data"]["worker"])), one
    # paused only once attempt 1's process runs (else it would start only at the wake)
    harness.wait_until(lambda: attempt_processes(job_id, 1), timeout=SETTLE_S,
                       message="attempt 1's sandboxed process never started")
    since, before = len(worker.log_text()), stack.stale_writes()
    spare: harness.Process | None = None
    try:
        with paused(worker) as wake:
            spare = stack.start_spare("tool")  # the one free to take the action again
            again = stack.wait_event(job_id, started("slow", 2), timeout=SETTLE_S)
            wake()  # attempt 2 runs: the woken attempt 1 is stale
            job = stack.wait_ended(job_id, timeout=SETTLE_S)
            wait_idle(stack, worker)
        events, woken_log, after = stack.events(job_id), worker.log_text()[since:], stack.stale_writes()
    finally:
        hand_over(stack, "tool", worker, spare)

    assert job["status"] == "completed", (job, [e["type"] for e in events])
    assert spare is not None and spare.owns_pid(pid_of(again["data"]["worker"])), again
    check_log_shape(events)
    assert [e["data"]["attempt"] for e in of(events, "action_started", "slow")] == [1, 2]
    redriven = [e for e in of(events, "warning") if e["data"].get("kind") == "action_redriven"]
    assert [e["data"]["action_id"] for e in redriven] == ["slow"], redriven
    # exactly one end, attempt 2's: the value it computed is the one it returned (its attempt)
    (done,) = terminal(events, "slow")
    assert done["type"] == "action_completed" and done["data"]["result"]["result"] == 2, done
    assert done["seq"] > again["seq"]
    record = result_record(stack, job_id, "slow")
    assert record["attempt"] == 2 and record["value"]["result"] == 2, record
    (view,) = [a for a in job["actions"] if a["id"] == "slow"]
    assert view["attempts"] == 2
    # the job record's timings are attempt 2's own (the issue's: started_at was attempt 1's)
    assert view["started_at"] >= again["ts"], (view, again)
    assert job["result"] == "2"
    # the woken worker knew its attempt was stale, said so, and the store counted the refusal
    assert TOOL_STALE.search(woken_log), woken_log[-4000:]
    if "stale write dropped" in woken_log:
        assert after.get("result", 0) > before.get("result", 0), (before, after)
    if first == NEVER_ENDS:  # it could only have ended by the heartbeat's check killing it
        assert re.search(r"attempt 1 of action slow is stale .*stopping it", woken_log), \
            woken_log[-4000:]
    assert attempt_processes(job_id, 1) == []  # nothing of the stale attempt is left running


def test_tool_worker_woken_before_its_action_ran_again(stack: Stack) -> None:
    """A pause well under `liveness_ttl_s`: the worker wakes still holding its lease, and its
    attempt is recorded as if nothing happened. Only the invariant is asserted strictly (one
    end, the recorded attempt is the current one, with its own value), so that a machine slow
    enough for the reconciler to act anyway still passes; the usual outcome (attempt 1, no
    redrive, nothing stale) is asserted when no redrive happened."""
    doc = (tool("slow", "python", {"code": snippet(first=4, later=4)})
           + "<response>$slow.result</response>")
    worker = stack.workers["tool"]
    job_id = stack.submit({"protocol": doc})
    first = stack.wait_event(job_id, started("slow", 1))
    assert worker.owns_pid(pid_of(first["data"]["worker"])), first
    since = len(worker.log_text())
    with paused(worker):
        time.sleep(1.5)  # the pause itself (nothing is asserted on it)
    job = stack.wait_ended(job_id, timeout=SETTLE_S)
    wait_idle(stack, worker)
    events, woken_log = stack.events(job_id), worker.log_text()[since:]

    assert job["status"] == "completed", (job, [e["type"] for e in events])
    check_log_shape(events)
    (done,) = terminal(events, "slow")
    assert done["type"] == "action_completed", done
    record = result_record(stack, job_id, "slow")
    (view,) = [a for a in job["actions"] if a["id"] == "slow"]
    starts = [e["data"]["attempt"] for e in of(events, "action_started", "slow")]
    # the invariant: the recorded attempt is the last one claimed, and the value is its own
    assert record["attempt"] == view["attempts"] == starts[-1] == len(starts), (record, starts)
    assert record["value"]["result"] == record["attempt"] == done["data"]["result"]["result"]
    assert job["result"] == str(record["attempt"])
    redriven = [e for e in of(events, "warning") if e["data"].get("kind") == "action_redriven"]
    if not redriven:  # the usual case: the pause changed nothing at all
        assert starts == [1] and record["attempt"] == 1
        assert not TOOL_STALE.search(woken_log), woken_log[-4000:]
    else:  # the machine was slow enough for the reconciler to act: attempt 1 was refused
        assert starts == [1, 2], starts
        assert TOOL_STALE.search(woken_log), woken_log[-4000:]


# ------------------------------------------------------------------------------ coordinators

#: The thought the agent's first turn streams, in numbered pieces: a chunk of the paused
#: coordinator's generation mixed into the regenerated one shows as a numbering out of order.
THOUGHT = "".join(f"p{i:02d} with care. " for i in range(40))
TURN_ONE = f"<thought>{THOUGHT}</thought>" + act("e", "echo", {"message": "once"}, mode="sync")
FINAL = '<response final="true">Done: $e</response>'
CHUNK_CHARS = 4
HOLD_AT = 24  # the stream stops after this token until the test lets it go on
#: The thought text sent before the hold: tokens 0..HOLD_AT, less `<thought>`.
HELD = THOUGHT[:(HOLD_AT + 1) * CHUNK_CHARS - len("<thought>")]


def thought(events: list[dict[str, Any]]) -> str:
    """The thought chunks joined, as a client reading them would show them."""
    return "".join(e["data"]["text"] for e in of(events, "thought_chunk"))


def after_restart(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events after the (one) `turn_restarted` warning."""
    (warning,) = [e for e in of(events, "warning") if e["data"].get("kind") == "turn_restarted"]
    return [e for e in events if e["seq"] > warning["seq"]]


def is_restart(event: dict[str, Any]) -> bool:
    return event["type"] == "warning" and event["data"].get("kind") == "turn_restarted"


def script_agent(stack: Stack, name: str, hold_first: threading.Event,
                 hold_again: threading.Event) -> str:
    """A model whose first turn is streamed twice (the paused coordinator's generation, then
    the regenerated one), each held after HOLD_AT tokens until its event is set, then a final
    turn. Returns the model's name."""
    model = f"{name}-{os.urandom(4).hex()}"
    stack.llm.script(model, [
        Turn(text=TURN_ONE, tokens_per_second=200, chunk_chars=CHUNK_CHARS,
             holds={HOLD_AT: hold_first}),
        Turn(text=TURN_ONE, tokens_per_second=200, chunk_chars=CHUNK_CHARS,
             holds={HOLD_AT: hold_again}),
        Turn(text=FINAL, tokens_per_second=2000)])
    return model


def start_and_hold(stack: Stack, model: str) -> tuple[str, harness.Process]:
    """Submit the agent job and wait until its coordinator logged every chunk sent before the
    hold (it is then blocked reading its held stream); returns the job and the coordinator."""
    coordinator = stack.workers["agent"]
    job_id = stack.submit({"agent": "tester", "input": "Think, then echo.",
                           "options": {"model": model}})
    harness.wait_until(lambda: thought(stack.events(job_id)) == HELD, timeout=SETTLE_S,
                       message=lambda: f"the chunks before the hold: {stack.events(job_id)}")
    owner = stack.client.hget(f"cx:{{{job_id}}}:job", "turn_owner")
    assert owner is not None and coordinator.owns_pid(pid_of(owner)), owner
    return job_id, coordinator


def check_agent_job(stack: Stack, job: dict[str, Any], events: list[dict[str, Any]],
                    model: str, coordinator: harness.Process) -> None:
    """What both coordinator tests demand of the job, whenever the paused one was woken."""
    assert job["status"] == "completed", (job, [e["type"] for e in events])
    assert job["result"] == "Done: once"
    check_log_shape(events)
    restarts = [e for e in events if is_restart(e)]
    assert [e["data"]["turn"] for e in restarts] == [1], restarts
    # the tester's endpoint cannot continue a partial answer: the turn is generated again
    # (and scripted so); a continued turn would need a script of its own
    assert not restarts[0]["data"].get("continued"), restarts
    before = [e for e in events if e["seq"] < restarts[0]["seq"]]
    # before the takeover: the paused coordinator's chunks, up to the hold, nothing after it
    assert thought(before) == HELD, thought(before)
    # after it: the regenerated thought exactly, once (no stale chunk interleaved)
    assert thought(after_restart(events)) == THOUGHT, thought(after_restart(events))
    assert [e["data"]["text"] for e in of(events, "thought_end")] == [THOUGHT]
    # the action the stale generation would have registered is registered and run once
    assert len(of(events, "action_queued", "e")) == 1
    assert [e["data"]["attempt"] for e in of(events, "action_started", "e")] == [1]
    assert len(terminal(events, "e")) == 1 and of(events, "action_completed", "e")
    assert [e["data"]["turn"] for e in of(events, "turn_started")] == [1, 2]
    owner = stack.client.hget(f"cx:{{{job['id']}}}:job", "turn_owner")
    assert owner is None or not coordinator.owns_pid(pid_of(owner)), owner
    # the woken coordinator asked the model for nothing more
    assert len(stack.llm.requests(model)) == 3 and stack.llm.remaining(model) == 0


def test_coordinator_woken_while_its_turn_is_regenerated(stack: Stack) -> None:
    """The issue's case: the coordinator is paused mid-thought with the rest of its stream
    arriving in its socket; another coordinator takes the turn over and regenerates it; the
    paused one is woken while the regenerated stream is held mid-way (so the job certainly
    still runs), and the regeneration is let go on only once the woken one is idle. A client
    must read the regenerated thought whole, with nothing of the stale one in it."""
    hold_first, hold_again = threading.Event(), threading.Event()
    model = script_agent(stack, "pause-wake-running", hold_first, hold_again)
    spare: harness.Process | None = None
    coordinator = stack.workers["agent"]
    try:
        job_id, coordinator = start_and_hold(stack, model)
        since, before = len(coordinator.log_text()), stack.stale_writes()
        with paused(coordinator) as wake:
            hold_first.set()  # the rest of its generation waits in its socket, unread
            spare = stack.start_spare("agent")
            stack.wait_event(job_id, is_restart, timeout=SETTLE_S)
            harness.wait_until(lambda: thought(after_restart(stack.events(job_id))) == HELD,
                               timeout=SETTLE_S, message=lambda: f"{stack.events(job_id)}")
            wake()
            wait_idle(stack, coordinator)
            assert stack.job(job_id)["status"] == "running"  # held: it cannot have ended
            hold_again.set()
            job = stack.wait_ended(job_id, timeout=SETTLE_S)
        events, woken_log = stack.events(job_id), coordinator.log_text()[since:]
        after = stack.stale_writes()
    finally:
        hold_first.set()
        hold_again.set()
        hand_over(stack, "agent", coordinator, spare)

    check_agent_job(stack, job, events, model, coordinator)
    # it tried to write and was refused (logged and counted), or it never wrote at all
    if TURN_STALE.search(woken_log):
        assert total(after) > total(before), (before, after)


def test_coordinator_woken_after_its_job_ended(stack: Stack) -> None:
    """The paused coordinator is woken only once the new coordinator has ended the job: it
    must log nothing after `job_completed` (not its chunks, not its turn's end or usage)."""
    hold_first, hold_again = threading.Event(), threading.Event()
    hold_again.set()  # the regenerated turn runs straight through
    model = script_agent(stack, "pause-wake-ended", hold_first, hold_again)
    spare: harness.Process | None = None
    coordinator = stack.workers["agent"]
    try:
        job_id, coordinator = start_and_hold(stack, model)
        since, before = len(coordinator.log_text()), stack.stale_writes()
        with paused(coordinator) as wake:
            hold_first.set()
            spare = stack.start_spare("agent")
            job = stack.wait_ended(job_id, timeout=SETTLE_S)
            ended = stack.events(job_id)
            wake()
            wait_idle(stack, coordinator)
        events, woken_log = stack.events(job_id), coordinator.log_text()[since:]
        after = stack.stale_writes()
    finally:
        hold_first.set()
        hand_over(stack, "agent", coordinator, spare)

    check_agent_job(stack, job, events, model, coordinator)
    assert events == ended, [(e["seq"], e["type"]) for e in events[len(ended):]]
    assert stack.job(job_id)["status"] == "completed"
    if TURN_STALE.search(woken_log):
        assert total(after) > total(before), (before, after)
