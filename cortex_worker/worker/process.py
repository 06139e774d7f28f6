"""A worker process's steps run in order: `Step`, the hooks one per-process service has, and
`Process`, which runs a list of them (the list: `cortex_worker.worker.steps.PROCESS`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

log = logging.getLogger(__name__)

Role = Literal["main", "child"]


@dataclass(frozen=True)
class ProcessContext:
    """What a step knows of its process: the worker's own (`main`) or a prefork `child`, and
    for the main one how the worker runs its tasks."""

    role: Role
    threaded: bool = False
    """The worker's pool runs its tasks on threads of this process."""
    concurrency: int = 1
    queues: frozenset[str] = frozenset()
    """The queues the worker consumes (its pools: agent, tool, ...)."""


class Step:
    """One per-process service. Each hook does nothing unless the step says otherwise."""

    name: ClassVar[str]

    def start(self, ctx: ProcessContext) -> None:
        """The process starts (before its first task)."""

    def shutting_down(self, ctx: ProcessContext) -> None:
        """A warm shutdown begins (the worker's own process; its tasks still run)."""

    def stop(self, ctx: ProcessContext) -> None:
        """The process stops (its tasks have ended)."""


class Process:
    """Runs `steps` in one process: started in order, stopped in reverse, only those that
    started. Once per process: a second start in the same process (a solo pool announces its
    process twice) is ignored, and a forked child starts its own."""

    def __init__(self, steps: Sequence[Step], pid: Callable[[], int] = os.getpid) -> None:
        self.steps = tuple(steps)
        self._pid = pid
        self._started_in: int | None = None
        self._started: list[Step] = []
        self._ctx = ProcessContext("main")

    def start(self, ctx: ProcessContext) -> None:
        """Start every step, in order (a step that raises stops the rest from starting)."""
        if self._started_in == self._pid():
            return
        self._started_in, self._started, self._ctx = self._pid(), [], ctx
        for step in self.steps:
            step.start(ctx)
            self._started.append(step)

    def shutting_down(self) -> None:
        """Tell the started steps, in reverse order, that a warm shutdown has begun."""
        if self._started_in == self._pid():
            for step in reversed(self._started):
                step.shutting_down(self._ctx)

    def stop(self) -> None:
        """Stop the started steps, in reverse order (one that fails does not stop the rest)."""
        if self._started_in != self._pid():
            return  # nothing started in this process
        started, self._started = self._started, []
        for step in reversed(started):
            try:
                step.stop(self._ctx)
            except Exception:  # the other steps still stop
                log.exception("worker step %s failed to stop", step.name)
