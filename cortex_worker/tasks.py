"""The Celery tasks. Bodies live in `executor` and `jobs`; these are thin entry points."""

from __future__ import annotations

from typing import Any, NoReturn

from celery import Task
from celery.signals import (
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_shutdown,
    worker_shutting_down,
)

from cortex_worker.actions import dispatch, executor
from cortex_worker.app import app
from cortex_worker.handles import get_store
from cortex_worker.jobs import feeds
from cortex_worker.jobs import lifecycle as jobs
from cortex_worker.jobs.turns import loop as coordinator
from cortex_worker.observability import tracing
from cortex_worker.recovery import reconciler
from cortex_worker.sandbox.process import install_sigterm_handler
from cortex_worker.settings import get_settings


@worker_process_init.connect
def _init_process(**_: Any) -> None:
    # A revoked (terminated) task must take its sandboxed processes with it.
    install_sigterm_handler()
    tracing.configure("cortex-worker")  # the exporter's thread does not survive the fork
    reconciler.start(get_store(), get_settings())  # a prefork child: it holds leases


@worker_init.connect
def _init_worker(sender: Any = None, **_: Any) -> None:
    # The worker's own process: threaded pools run their tasks here; a prefork parent beats
    # and reconciles too (its children start their own heartbeat after the fork).
    tracing.configure("cortex-worker")
    reconciler.start(get_store(), get_settings())
    if sender is not None and "thread" in str(sender.pool_cls) \
            and "agent" in sender.app.amqp.queues.consume_from:
        coordinator.wait_in_place(int(sender.concurrency))


@worker_shutting_down.connect
def _stop_waiting(**_: Any) -> None:
    coordinator.stop_waiting()  # a warm shutdown does not wait for turns that only wait


@worker_process_shutdown.connect
@worker_shutdown.connect
def _flush_traces(**_: Any) -> None:
    tracing.flush()


@app.task(name="cortex.start_job", ignore_result=True)
def start_job(job_id: str) -> None:
    """Start a document job: log its parse and dispatch its first actions."""
    jobs.start_job(get_store(), job_id)


@app.task(name="cortex.action", bind=True, ignore_result=True, max_retries=None)
def run_action(self: Task, job_id: str, action_id: str, spec: dict[str, Any] | None = None,
               trigger: bool | None = None) -> str:
    """Run one action. Readiness dispatch sends the spec and `trigger`: the task sends the
    dependents its end makes ready. A canvas step sends only the ids (its chain message
    carries every later step): the spec is read from the job, and Celery sends the next
    steps (`trigger` is false)."""
    return _execute(self, job_id, action_id, spec, spec is not None if trigger is None else trigger)


@app.task(name="cortex.action.canvas", bind=True, ignore_result=True, max_retries=None)
def run_canvas_action(self: Task, job_id: str, action_id: str,
                      spec: dict[str, Any] | None = None, trigger: bool = False) -> str:
    """Canvas steps sent by an earlier version; canvas steps are `cortex.action` tasks now."""
    return _execute(self, job_id, action_id, spec, trigger)


def _execute(task: Task, job_id: str, action_id: str, spec: dict[str, Any] | None,
             trigger: bool) -> str:
    def again(countdown: float) -> NoReturn:
        # Another delivery holds the action: this same message is delivered again later. A
        # canvas step keeps its place in its chain (the chain does not move on before the
        # action has ended), and no worker slot waits meanwhile.
        raise task.retry(countdown=countdown)

    return executor.execute(job_id, action_id, spec, trigger, None if trigger else again)


@app.task(name="cortex.agent_turn", ignore_result=True)
def agent_turn(job_id: str) -> None:
    """Run an agent job's next turn (it returns while the turn's actions run)."""
    coordinator.run_turns(get_store(), job_id)


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
