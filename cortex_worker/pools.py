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
"""Every pool: its queue's first lane has its name."""
LANES = 16
"""Each pool's queue is split in this many lanes, the tenants spread over them (one each while
there are no more tenants than lanes; `actions/fairness.py`). A worker takes from its pool's
lanes in turn, so one tenant's backlog waits behind its own work, not in front of others'."""


def lanes(pool: str) -> tuple[str, ...]:
    """The Celery queues of a pool: `<pool>` (lane 0, the default tenant's), `<pool>.1` ..."""
    return (pool, *(f"{pool}.{lane}" for lane in range(1, LANES)))


PRIORITIES = 10
"""A job's priority, 0 (the default, first) to 9: kombu's priority steps, a list per lane each."""
KOMBU_PRIORITY_SEP = "\x06\x16"
"""How kombu's Redis transport names a priority's list: `<queue><sep><priority>`."""


def broker_lists(pool: str) -> list[str]:
    """The Redis lists kombu's Redis transport keeps a pool's queued messages in: each lane's,
    one per priority (priority 0's, the default's, has the lane's own name)."""
    return [lane if pri == 0 else f"{lane}{KOMBU_PRIORITY_SEP}{pri}"
            for lane in lanes(pool) for pri in range(PRIORITIES)]


def lane_queue(pool: str, lane: int) -> str:
    """The queue of one lane of a pool."""
    return pool if lane == 0 else f"{pool}.{lane}"
UP: tuple[str, ...] = tuple(pool.name for pool in TABLE if pool.up)
"""The pools `cortex up` and `cortex demo` start unless told otherwise."""
BY_NAME: dict[str, Pool] = {pool.name: pool for pool in TABLE}
