"""The Celery tasks. Bodies live in `executor` and `jobs`; these are thin entry points. What
each worker process runs besides them is `cortex_worker.worker.steps`."""

from __future__ import annotations

from functools import partial
from typing import Any, NoReturn

from celery import Task

from cortex_worker.actions import dispatch, executor
from cortex_worker.app import app
from cortex_worker.handles import get_store
from cortex_worker.jobs import feeds
from cortex_worker.jobs import lifecycle as jobs
from cortex_worker.jobs.turns import loop
from cortex_worker.plan import canvas
from cortex_worker.worker import signals, steps

# Every worker imports this module (the app's `include`): its processes run the steps.
signals.connect_process(steps.PROCESS)
signals.connect_messages()


@app.task(name="cortex.start_job", ignore_result=True)
def start_job(job_id: str) -> None:
    """Start a document job: log its parse and dispatch its first actions."""
    jobs.start_job(get_store(), job_id)


@app.task(name="cortex.action", bind=True, ignore_result=True, max_retries=None)
def run_action(self: Task, job_id: str, action_id: str, spec: dict[str, Any] | None = None,
               trigger: bool | None = None, ahead: bool = False) -> str:
    """Run one action. Readiness dispatch sends the spec and `trigger`: the task sends the
    dependents its end makes ready (`ahead`: this message went before its dependency's
    finish). A canvas step sends the ids, and the spec with `trigger` false when the step
    before it had it (plan/canvas.py: `hand_on`; else the spec is read from the job); the
    step sends the next one (`canvas.forward`)."""
    return _execute(self, job_id, action_id, spec, spec is not None if trigger is None else trigger,
                    ahead)


@app.task(name="cortex.action.canvas", bind=True, ignore_result=True, max_retries=None)
def run_canvas_action(self: Task, job_id: str, action_id: str,
                      spec: dict[str, Any] | None = None, trigger: bool = False) -> str:
    """Canvas steps sent by an earlier version; canvas steps are `cortex.action` tasks now."""
    return _execute(self, job_id, action_id, spec, trigger)


def _execute(task: Task, job_id: str, action_id: str, spec: dict[str, Any] | None,
             trigger: bool, ahead: bool = False) -> str:
    def again(countdown: float) -> NoReturn:
        # Another delivery holds the action: this same message is delivered again later. A
        # canvas step keeps its place in its chain (the chain does not move on before the
        # action has ended), and no worker slot waits meanwhile.
        raise task.retry(countdown=countdown)

    if trigger:
        delivery = executor.Delivery(ahead=ahead)
    else:
        delivery = executor.Delivery(again=again, tries=task.request.retries or 0,
                                     forward=partial(canvas.forward, task, job_id))
    return executor.execute(job_id, action_id, spec, trigger, delivery)


@app.task(name="cortex.agent_turn", ignore_result=True)
def agent_turn(job_id: str) -> None:
    """Run an agent job's next turn (it returns while the turn's actions run)."""
    loop.run_turns(get_store(), job_id)


@app.task(name="cortex.invoke")
def invoke(job_id: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one target outside any plan (a context feed's source) and return its value."""
    return executor.invoke(job_id, spec, timeout)


@app.task(name="cortex.feed_refresh", ignore_result=True)
def feed_refresh(job_id: str, feed_id: str, generation: int) -> None:
    """Refresh a periodic context feed and schedule the next refresh."""
    delay = feeds.refresh(get_store(), job_id, feed_id, generation)
    if delay is not None:
        dispatch.refresh_feed(job_id, feed_id, generation, countdown=delay)


@app.task(name="cortex.deferred_timeout", ignore_result=True)
def deferred_timeout(job_id: str, action_id: str) -> None:
    """End a child-job action that outlived its timeout."""
    jobs.expire_deferred(get_store(), job_id, action_id)
