"""Celery's signals, connected here and nowhere else (each once: `dispatch_uid`).

- A worker process's lifecycle runs the steps of `cortex_worker.worker.steps.PROCESS`
  (`connect_process`, by `cortex_worker.tasks`, which every worker imports).
- The worker's exit code is kept for `cortex worker` to exit with (`connect_exit_code`).
- A task message carries the trace of the span that sends it, and the task's span opens
  under it (`connect_messages`: in the workers, and in the API, which sends jobs' starts).

This module imports no step (the API imports it, and must not load the sandbox): the process
is handed in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import signals

from cortex_worker.observability import tracing
from cortex_worker.worker.process import Process, ProcessContext

PREFIX = "cortex."
"""The `dispatch_uid` of every receiver connected here starts with it."""


def connect_process(process: Process) -> None:
    """Run `process`'s steps at Celery's worker and pool-process signals."""

    def main(sender: Any = None, **_: Any) -> None:
        process.start(main_context(sender))

    def child(**_: Any) -> None:
        process.start(ProcessContext("child"))

    def shutting_down(**_: Any) -> None:
        process.shutting_down()

    def stop(**_: Any) -> None:
        process.stop()

    signals.worker_init.connect(main, weak=False, dispatch_uid=f"{PREFIX}start")
    signals.worker_process_init.connect(child, weak=False, dispatch_uid=f"{PREFIX}start-child")
    signals.worker_shutting_down.connect(shutting_down, weak=False,
                                         dispatch_uid=f"{PREFIX}shutting-down")
    signals.worker_shutdown.connect(stop, weak=False, dispatch_uid=f"{PREFIX}stop")
    signals.worker_process_shutdown.connect(stop, weak=False, dispatch_uid=f"{PREFIX}stop-child")


def connect_exit_code() -> Callable[[], int]:
    """Keep the exit code the worker ends with; the returned function reads it (0 until it
    ends). Celery's `worker_main` drops it, so a worker that stopped on an "Unrecoverable
    error" (code 1) would exit 0 and a supervisor would not restart it."""
    codes: list[int] = [0]

    def ended(sender: Any = None, **_: Any) -> None:
        codes[0] = max(codes[0], int(getattr(sender, "exitcode", None) or 0))

    signals.worker_shutdown.connect(ended, weak=False, dispatch_uid=f"{PREFIX}exit-code")
    return lambda: codes[0]


def connect_messages() -> None:
    """Trace context on task messages (no-ops unless `tracing.configure` exports)."""
    signals.before_task_publish.connect(tracing.inject_headers, weak=False,
                                        dispatch_uid=f"{PREFIX}trace-publish")
    signals.task_prerun.connect(tracing.start_task_span, weak=False,
                                dispatch_uid=f"{PREFIX}trace-task-start")
    signals.task_postrun.connect(tracing.end_task_span, weak=False,
                                 dispatch_uid=f"{PREFIX}trace-task-end")


def main_context(worker: Any) -> ProcessContext:
    """The worker's own process, as its `WorkController` (`worker_init`'s sender) describes it."""
    if worker is None:
        return ProcessContext("main")
    return ProcessContext("main", threaded="thread" in str(worker.pool_cls),
                          concurrency=int(worker.concurrency),
                          queues=frozenset(worker.app.amqp.queues.consume_from))
