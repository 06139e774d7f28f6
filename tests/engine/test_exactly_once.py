"""At-least-once delivery, exactly-once results: a task delivered again after its action
was recorded does not run the action again (in-process engine, real Redis)."""

from __future__ import annotations

from cortex_worker.actions import dispatch
from cortex_worker.jobs import lifecycle as jobs
from cortex_worker.store.state import Store
from cortex_worker.testing import StubBroker
from tests.engine.helpers import action, events, of


def test_redelivered_action_is_not_run_again(store: Store, broker: StubBroker) -> None:
    doc = action("once", "echo", {"message": "hi"}) + action("next", "echo", {"message": "$once"})
    job_id = jobs.submit_document(store, doc)
    broker.join()
    assert events(store, job_id)[-1]["type"] == "job_completed"
    assert store.actions(job_id)["once"]["attempts"] == 1

    # Deliver the finished action's task again, as the broker does after a worker dies.
    full = {"id": "once", "type": "tool", "mode": "async", "name": "echo",
            "parameters": {"message": "hi"}, "output_key": None, "depends_on": [], "after": [],
            "timeout": None, "retry": 0, "on_error": "fail", "in_thought": False}
    again = [
        broker.send_task(dispatch.ACTION_TASK, [job_id, "once", full, True], queue="tool"),
        broker.send_task(dispatch.ACTION_TASK, [job_id, "once"], queue="tool"),  # a canvas step
        # as a canvas step sent by an earlier version, under the task name it had then
        broker.send_task("cortex.action.canvas", [job_id, "once"], queue="tool"),
    ]
    broker.join()
    assert [(m.message.name, m.message.state) for m in again] == [
        (dispatch.ACTION_TASK, "done"), (dispatch.ACTION_TASK, "done"),
        ("cortex.action.canvas", "done")]
    log = events(store, job_id)
    assert len(of(log, "action_started")) == 2  # once and next, never again
    assert store.get_job(job_id).status == "completed"  # type: ignore[union-attr]
    assert [a["attempts"] for a in store.actions(job_id).values()] == [1, 1]
    assert len(of(log, "action_completed")) == 2
