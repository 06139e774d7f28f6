"""What every worker process runs, as one ordered list of steps (`PROCESS`), like Celery's
bootsteps or Dramatiq's middleware.

A worker process starts the steps in order: the worker's own process as the worker starts
(`worker_init`: a threaded pool runs its tasks there, a prefork parent beats and reconciles
too), and each prefork child right after its fork (`worker_process_init`: it inherits its
parent's memory, not its threads). At shutdown it stops the steps it started, in reverse
order; the worker's own process also tells them first that a warm shutdown has begun.
`cortex_worker.worker.signals` connects Celery's signals to `PROCESS`, once.

Started on first use instead, in whichever process needs them, so not steps: the job-end
listener (`jobs.ends`) and the chunk writer (`store.chunk_writer`) start their thread at
their first use, again in a forked child; warm runners (`sandbox.warm`) start a zygote at a
python tool's first call, take a new lock after any fork (`os.register_at_fork`, which also
sees forks Celery does not announce), and their zygotes exit with the worker. The task events
publisher and the service pools start on first use too; their steps stop them.
"""

from __future__ import annotations

from cortex_worker.handles import get_store
from cortex_worker.jobs.turns import waiting
from cortex_worker.observability import task_events, tracing
from cortex_worker.recovery import reconciler
from cortex_worker.recovery.liveness import Heartbeat
from cortex_worker.sandbox.process import install_sigterm_handler
from cortex_worker.services.pool import service_pools
from cortex_worker.settings import get_settings
from cortex_worker.worker.process import Process, ProcessContext, Step


class SandboxGroups(Step):
    """A revoked (terminated) task takes its sandboxed processes with it: SIGTERM kills every
    live sandbox group of a prefork child (`sandbox.process.kill_all`)."""

    name = "sandbox-groups"

    def start(self, ctx: ProcessContext) -> None:
        if ctx.role == "child":
            install_sigterm_handler()


class Tracing(Step):
    """Export this process's spans (if an OTLP endpoint is set: the exporter's thread does not
    survive a fork), and what is buffered when it stops."""

    name = "tracing"

    def start(self, ctx: ProcessContext) -> None:
        tracing.configure("cortex-worker")

    def stop(self, ctx: ProcessContext) -> None:
        tracing.flush()


class Beating(Step):
    """The process's heartbeat (it holds leases), which also runs the reconciler's passes."""

    name = "heartbeat"

    def __init__(self) -> None:
        self.heartbeat: Heartbeat | None = None

    def start(self, ctx: ProcessContext) -> None:
        self.heartbeat = reconciler.heartbeat(get_store(), get_settings()).start()

    def stop(self, ctx: ProcessContext) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()


class TaskEvents(Step):
    """The task events still queued go out before the process exits (a prefork child exits
    without running `atexit`)."""

    name = "task-events"

    def stop(self, ctx: ProcessContext) -> None:
        task_events.drain_all()


class TurnWaits(Step):
    """A threaded agent worker lets turns wait in place for their actions (half its threads);
    a warm shutdown does not wait for turns that only wait."""

    name = "turn-waits"

    def start(self, ctx: ProcessContext) -> None:
        if ctx.role == "main" and ctx.threaded and "agent" in ctx.queues:
            waiting.wait_in_place(ctx.concurrency)

    def shutting_down(self, ctx: ProcessContext) -> None:
        waiting.stop_waiting()


class Services(Step):
    """Relics and MCP servers this process started (`services.pool`) are stopped with it."""

    name = "services"

    def stop(self, ctx: ProcessContext) -> None:
        service_pools().stop_all()


PROCESS = Process([SandboxGroups(), Tracing(), Beating(), TaskEvents(), TurnWaits(), Services()])
"""The steps of every worker process, in the order they start."""
