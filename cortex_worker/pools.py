"""The worker pools: one row each, the one list the Celery queues, `cortex worker` and
`cortex up` read.

Kept apart from `app.py`, which builds the Celery app (and reads the settings) when imported:
the CLI's help and the stack need the table without that.
"""

from __future__ import annotations

from dataclasses import dataclass

from cortex_worker.settings import AGENT_THREADS


@dataclass(frozen=True)
class Pool:
    """One pool: its queue has its name. `threaded` pools wait on I/O, so threads carry many
    tasks per process; the others run code in processes, so a revoked task can be killed with
    its sandbox. `concurrency` is the default slots (None: Celery's, the number of CPUs)."""

    name: str
    threaded: bool
    concurrency: int | None
    up: bool
    description: str


TABLE: tuple[Pool, ...] = (
    Pool("agent", True, AGENT_THREADS, True, "document starts, agent turns, agent actions"),
    Pool("tool", False, None, True, "built-in, python and shell tools"),
    Pool("llm", True, 50, True, "llm actions"),
    # One worker process keeps one instance of each relic: its threads share them.
    Pool("relic", True, 8, True, "relic actions and MCP servers; relics' processes live in it"),
    Pool("docker", False, None, False, "tools with runtime: docker, through the Docker Engine"),
)

NAMES: tuple[str, ...] = tuple(pool.name for pool in TABLE)
"""Every pool, hence every Celery queue."""
UP: tuple[str, ...] = tuple(pool.name for pool in TABLE if pool.up)
"""The pools `cortex up` and `cortex demo` start unless told otherwise."""
BY_NAME: dict[str, Pool] = {pool.name: pool for pool in TABLE}
