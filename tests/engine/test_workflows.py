"""Workflow jobs through the engine in-process, a child workflow as a step included."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from cortex_worker.actions import dispatch
from cortex_worker.jobs import lifecycle as jobs
from cortex_worker.jobs.options import JobOptions
from cortex_worker.store.state import Store
from cortex_worker.testing import CANVAS, Message, StubBroker
from tests.engine.helpers import events, of, one, status


@pytest.mark.parametrize("canvas", [False, True], ids=["readiness", "canvas"])
def test_a_workflow_with_a_child_workflow_step(store: Store, broker: StubBroker,
                                               canvas: bool) -> None:
    job_id = jobs.submit_workflow(store, "nested", {"n": 3}, options=JobOptions(canvas=canvas))
    broker.join()
    assert status(store, job_id) == "completed"
    child_id = jobs.child_job_id(job_id, "inner")
    assert store.children(job_id) == {child_id}

    parent = store.get_job(job_id)
    child = store.get_job(child_id)
    assert parent is not None and child is not None
    assert (child.kind, child.workflow, child.status, child.parent_job, child.parent_action,
            child.depth) == ("workflow", "diamond", "completed", job_id, "inner", 1)
    assert child.options.canvas is canvas  # a child inherits its parent's options
    # diamond(x=3): double 6, plus_one 7, copy 6; its output, then final = total * 10
    output = {"label": "sum", "total": 7, "copy": 6, "text": "x=3"}
    assert store.variables(child_id, ["double", "plus_one", "copy"]) == {
        "double": 6, "plus_one": 7, "copy": 6}

    log = events(store, job_id)
    assert one(log, "child_job")["job_id"] == child_id
    assert one(log, "action_completed", "inner")["result"] == output
    assert one(log, "action_completed", "final")["result"] == 70
    assert one(log, "job_completed")["result"] == 70
    seq = {(e["type"], e["data"].get("action_id")): e["seq"] for e in log}
    assert seq[("action_started", "final")] > seq[("action_completed", "inner")]
    child_log = events(store, child_id)
    assert one(child_log, "job_completed")["result"] == output
    assert len(of(child_log, "action_completed")) == 4

    # readiness: each step's message; canvas: `inner` runs in the canvas, where `final`
    # waits for it in vain (the child is still running): the child's end sends `final`
    parent_actions = [m.args[1] for m in broker.ran
                      if m.name == dispatch.ACTION_TASK and m.args[0] == job_id]
    assert parent_actions == (["final"] if canvas else ["inner", "final"])
    assert len([m for m in broker.ran if m.name == CANVAS]) == (2 if canvas else 0)

def test_a_failing_child_fails_its_step_and_the_parent(store: Store, broker: StubBroker) -> None:
    job_id = jobs.submit_workflow(store, "failing", {"reason": "no luck"},
                                  options=JobOptions(canvas=False))
    broker.join()
    assert status(store, job_id) == "failed"
    log = events(store, job_id)
    assert "no luck" in one(log, "action_failed", "bad")["error"]
    assert one(log, "action_skipped", "after")["reason"] == "dependency bad did not succeed"
    assert store.action_statuses(job_id) == {"ok": "ok", "bad": "error", "after": "skipped"}
    error = one(log, "job_failed")["error"]
    assert "'failing'" in error and "bad" in error and "no luck" in error, error


def test_cancelling_the_parent_cancels_the_running_child(store: Store,
                                                         broker: StubBroker) -> None:
    job_id = jobs.submit_workflow(store, "nested", {"n": 1}, options=JobOptions(canvas=False))
    broker.step()  # the parent's start: `inner` is sent
    broker.step()  # `inner` submits the child workflow and hands its lease over
    child_id = jobs.child_job_id(job_id, "inner")
    assert status(store, child_id) == "queued"
    assert store.action_status(job_id, "inner") == "running"
    jobs.cancel_job(store, job_id)
    broker.join()
    assert status(store, job_id) == "cancelled"
    assert status(store, child_id) == "cancelled"
    assert one(events(store, child_id), "job_cancelled")["reason"] == \
        f"its parent job {job_id} ended"
    assert of(events(store, child_id), "action_started") == []
    assert store.action_statuses(job_id) == {"inner": "cancelled", "final": "cancelled"}


def workflow_action(ident: str, name: str, params: dict[str, object], timeout: float) -> str:
    body = {"name": name, "parameters": params, "timeout": timeout}
    return f'<action type="workflow" mode="async" id="{ident}">{json.dumps(body)}</action>\n'


def test_a_child_that_ends_in_time_beats_its_timeout(store: Store, broker: StubBroker) -> None:
    doc = workflow_action("w", "sleepy", {"seconds": 0}, timeout=30)
    job_id = jobs.submit_document(store, doc, options=JobOptions(canvas=False))
    broker.join()
    assert status(store, job_id) == "completed"
    assert one(events(store, job_id), "action_completed", "w")["result"] == {"slept": 0}
    (check,) = broker.messages(dispatch.DEFERRED_TASK, sent=True)
    assert (check.countdown, check.state) == (30, "done")
    assert broker.ran[-1] is check  # it waited for every message without a countdown
    assert broker.clock == 30


def outlive_timeout(store: Store, broker: StubBroker) -> tuple[str, str]:
    """A document whose one action runs a child workflow that does not start within the
    action's timeout; returns (job id, child id) once everything ran."""
    doc = workflow_action("w", "sleepy", {"seconds": 0}, timeout=5)
    job_id = jobs.submit_document(store, doc, options=JobOptions(canvas=False))
    broker.step()  # the start
    broker.step()  # `w` submits the child and sends its timeout check
    (start,) = broker.drop(dispatch.START_TASK)  # the child does not start in time
    child_id = jobs.child_job_id(job_id, "w")
    assert start.args == [child_id]
    broker.join()
    return job_id, child_id


def test_a_child_that_outlives_its_timeout_is_cancelled(store: Store,
                                                        broker: StubBroker) -> None:
    job_id, child_id = outlive_timeout(store, broker)
    assert [m.name for m in broker.ran[-1:]] == [dispatch.DEFERRED_TASK]
    assert status(store, job_id) == "failed"
    failed = one(events(store, job_id), "action_failed", "w")
    assert (failed["status"], failed["error"]) == (
        "timeout", "timed out after 5s; its child job was cancelled")
    assert status(store, child_id) == "cancelled"
    assert of(events(store, child_id), "action_started") == []


def test_the_child_of_a_timed_out_action_is_told_why(store: Store, broker: StubBroker) -> None:
    job_id, child_id = outlive_timeout(store, broker)
    assert one(events(store, child_id), "job_cancelled")["reason"] == (
        f"the action 'w' of job {job_id} that started it timed out")


# ---------------------------------------------------------------- moved from tests/integration

DIAMOND_X3 = {"label": "sum", "total": 7, "copy": 6, "text": "x=3"}


def results(log: list[dict[str, Any]]) -> dict[str, Any]:
    return {e["data"]["action_id"]: e["data"]["result"] for e in of(log, "action_completed")}


def seq(log: list[dict[str, Any]], kind: str, action_id: str) -> int:
    (event,) = [e for e in log if e["type"] == kind and e["data"].get("action_id") == action_id]
    return int(event["seq"])


def tool_action(ident: str, name: str, params: dict[str, Any], **extra: Any) -> str:
    body = {"name": name, "parameters": params, **extra}
    return f'<action type="tool" mode="async" id="{ident}">{json.dumps(body)}</action>\n'


def in_document(ident: str, name: str, inputs: dict[str, Any], **extra: Any) -> str:
    body = {"name": name, "parameters": inputs, **extra}
    return f'<action type="workflow" mode="async" id="{ident}">{json.dumps(body)}</action>\n'


def step_of_the_child(broker: StubBroker, child_id: str) -> list[Message]:
    """Run messages until the child job's step is queued; its queued action messages."""
    while True:
        found = [m for m in broker.messages(dispatch.ACTION_TASK) if m.args[0] == child_id]
        if found:
            return found
        assert broker.step() is not None, "the child never sent its step"


@pytest.mark.parametrize("canvas", [True, False], ids=["canvas", "readiness"])
def test_diamond_runs(store: Store, broker: StubBroker, canvas: bool) -> None:
    job_id = jobs.submit_workflow(store, "diamond", {"x": 3}, options=JobOptions(canvas=canvas))
    broker.join()
    log = events(store, job_id)
    assert log[0]["type"] == "job_queued"
    assert log[0]["data"]["workflow"] == "diamond" and log[0]["data"]["steps"] == 4
    assert [e["data"]["action"]["id"] for e in of(log, "action_parsed")] == [
        "double", "plus_one", "copy", "join"]
    assert results(log) == {"double": 6, "plus_one": 7, "copy": 6,
                            "join": {"plus_one": 7, "copy": 6}}
    # the DAG's order: the two middle steps after `double`, `join` after both
    for middle in ("plus_one", "copy"):
        assert seq(log, "action_started", middle) > seq(log, "action_completed", "double")
        assert seq(log, "action_started", "join") > seq(log, "action_completed", middle)
    end = log[-1]
    assert end["type"] == "job_completed" and end["data"]["result"] == DIAMOND_X3
    job = store.get_job(job_id)
    assert job is not None and (job.status, job.kind) == ("completed", "workflow")
    assert json.loads(job.result) == DIAMOND_X3
    assert job.dispatch == ("canvas" if canvas else "readiness")


def test_a_workflow_step_runs_a_child_workflow(store: Store, broker: StubBroker) -> None:
    job_id = jobs.submit_workflow(store, "nested", {"n": 2})
    broker.join()
    log = events(store, job_id)
    assert log[-1]["type"] == "job_completed", log[-1]
    assert log[-1]["data"]["result"] == 50  # diamond(2): total 5; times ten
    child = store.get_job(one(log, "child_job", "inner")["job_id"])
    assert child is not None
    assert (child.parent_job, child.parent_action, child.status) == (job_id, "inner", "completed")
    assert results(log)["inner"]["total"] == 5


def test_workflow_action_in_a_document(store: Store, broker: StubBroker) -> None:
    doc = (in_document("wf", "diamond", {"x": 5, "label": "five"})
           + tool_action("use", "echo", {"message": "${wf.total}"})
           + tool_action("free", "echo", {"message": "independent"})
           + "<response>Total: ${wf.total} ($wf.label)</response>")
    job_id = jobs.submit_document(store, doc)
    broker.join()
    log = events(store, job_id)
    assert log[-1]["type"] == "job_completed", log[-1]
    output = {"label": "five", "total": 11, "copy": 10, "text": "x=5"}
    assert results(log) == {"wf": output, "use": 11, "free": "independent"}
    assert seq(log, "action_started", "use") > seq(log, "action_completed", "wf")
    assert one(log, "response_end")["text"] == "Total: 11 (five)"
    child_id = one(log, "child_job", "wf")["job_id"]
    assert child_id == uuid.uuid5(uuid.NAMESPACE_URL, f"cortex:{job_id}:wf").hex
    child = store.get_job(child_id)
    assert child is not None
    assert (child.kind, child.parent_job, child.parent_action, child.status) == (
        "workflow", job_id, "wf", "completed")
    assert json.loads(child.result) == output
    child_log = events(store, child_id)
    assert child_log[0]["data"]["parent_job"] == job_id
    assert child_log[-1]["data"]["result"] == output


def test_a_failing_step_fails_the_run(store: Store, broker: StubBroker) -> None:
    job_id = jobs.submit_workflow(store, "failing", {"reason": "boom"})
    broker.join()
    log = events(store, job_id)
    assert "boom" in one(log, "action_failed", "bad")["error"]
    assert one(log, "action_skipped", "after")["reason"] == "dependency bad did not succeed"
    end = log[-1]
    assert end["type"] == "job_failed" and end["data"]["result"] is None
    error = end["data"]["error"]
    assert error.startswith("workflow 'failing': step 'bad' (tool fail) failed: ")
    assert "boom" in error and error.endswith("; not run: after")
    assert store.get_job(job_id).error == error  # type: ignore[union-attr]


def test_a_failing_child_fails_the_parent_action(store: Store, broker: StubBroker) -> None:
    doc = (in_document("wf", "failing", {"reason": "kaput"})
           + tool_action("use", "echo", {"message": "$wf"})
           + tool_action("free", "echo", {"message": "still runs"}))
    job_id = jobs.submit_document(store, doc)
    broker.join()
    log = events(store, job_id)
    failed = one(log, "action_failed", "wf")
    assert "workflow 'failing': step 'bad' (tool fail) failed" in failed["error"]
    assert "kaput" in failed["error"]
    assert one(log, "action_skipped", "use")["reason"] == "dependency wf did not succeed"
    assert results(log) == {"free": "still runs"}
    assert log[-1]["type"] == "job_failed"
    assert status(store, one(log, "child_job", "wf")["job_id"]) == "failed"
    # the engine goes on: the next run completes
    again_id = jobs.submit_workflow(store, "diamond", {"x": 3})
    broker.join()
    again = events(store, again_id)
    assert again[-1]["type"] == "job_completed" and again[-1]["data"]["result"] == DIAMOND_X3


def test_cancelling_a_child_fails_the_parent_action(store: Store, broker: StubBroker) -> None:
    doc = (in_document("wf", "sleepy", {"seconds": 120})
           + tool_action("use", "echo", {"message": "$wf"}))
    job_id = jobs.submit_document(store, doc, options=JobOptions(canvas=False))
    child_id = uuid.uuid5(uuid.NAMESPACE_URL, f"cortex:{job_id}:wf").hex
    step_of_the_child(broker, child_id)
    assert jobs.cancel_job(store, child_id) is True  # its two minutes' nap never runs
    broker.join()
    log = events(store, job_id)
    assert "cancelled" in one(log, "action_failed", "wf")["error"]
    assert one(log, "action_skipped", "use")
    assert log[-1]["type"] == "job_failed"
    assert status(store, child_id) == "cancelled"


def test_a_child_job_action_past_its_timeout_times_out_and_cancels_the_child(
        store: Store, broker: StubBroker) -> None:
    doc = (in_document("slow", "sleepy", {"seconds": 120}, timeout=1)
           + tool_action("after", "echo", {"message": "never"}, depends_on=["slow"]))
    job_id = jobs.submit_document(store, doc, options=JobOptions(canvas=False))
    child_id = jobs.child_job_id(job_id, "slow")
    step_of_the_child(broker, child_id)
    (nap,) = step_of_the_child(broker, child_id)
    broker.drop(task_id=nap.task_id)  # a worker naps on it for two minutes
    broker.join()  # the timeout check falls due
    log = events(store, job_id)
    failed = one(log, "action_failed", "slow")
    assert failed["status"] == "timeout" and "child job was cancelled" in failed["error"]
    assert one(log, "action_skipped", "after")
    assert status(store, child_id) == "cancelled"
