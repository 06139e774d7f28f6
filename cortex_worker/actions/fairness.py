"""Fair by tenant (architecture.md: "each pool takes their work in turn").

Celery queues are FIFO: one tenant's backlog would sit in front of everyone's work. So each
pool's queue is split in lanes (`pools.LANES`), and every tenant's messages go to its own lane
(given once, in Redis, to the lane with the fewest tenants: while there are no more tenants
than lanes, each has one alone). A worker consumes all the lanes of its pool, and kombu's Redis
transport takes from them in turn (it moves the lane it just took from to the end of its
`BRPOP`), so with several tenants waiting each gets every n-th free slot, and a tenant alone
gets the whole pool. A redelivered message, a canvas step and a retried task stay in their
lane: its name is the message's routing key.

Within a lane, a job's `priority` orders the tenant's own work: its messages carry it (kombu's
priority: 0, the default, first), and a worker takes each lane's priorities in order, lane by
lane (`worker/kombu_fixes.py`), so a priority never puts one tenant before another.

A tenant may also be capped on actions running at once (`Quota.max_actions_in_flight`): its
actions take a slot of the gate `tenant:<name>` (`gates`) as a `max_concurrency` tool's take
one of `tool:<name>`, and wait in line for it the same way.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from cortex_worker.handles import get_store
from cortex_worker.jobs.options import JobOptions
from cortex_worker.jobs.record import DEFAULT_TENANT, JobRecord
from cortex_worker.pools import LANES, lane_queue
from cortex_worker.settings import get_settings

JOBS_REMEMBERED = 65536
"""Jobs whose lane this process remembers (a job's tenant never changes)."""


class _Lanes:
    """This process's memory of each tenant's lane and each job's lane and priority. Never
    wrong, only late: a lane given in another Redis (a test's) is still one workers consume."""

    def __init__(self) -> None:
        self.tenants: dict[str, int] = {DEFAULT_TENANT: 0}
        self.jobs: OrderedDict[str, tuple[int, int, str]] = OrderedDict()
        self.lock = threading.Lock()

    def of_tenant(self, tenant: str) -> int:
        lane = self.tenants.get(tenant)
        if lane is None:
            lane = get_store().tenant_lane(tenant, LANES)
            self.tenants[tenant] = lane
        return lane

    def of_job(self, job_id: str) -> tuple[int, int, str]:
        """(its tenant's lane, its priority, its tenant)."""
        with self.lock:
            known = self.jobs.get(job_id)
            if known is not None:
                self.jobs.move_to_end(job_id)
                return known
        record = get_store().peek(job_id, "tenant", "options") or JobRecord(id=job_id)
        known = (self.of_tenant(record.tenant), (record.options or JobOptions()).priority,
                 record.tenant)
        with self.lock:
            self.jobs[job_id] = known
            while len(self.jobs) > JOBS_REMEMBERED:
                self.jobs.popitem(last=False)
        return known


_lanes = _Lanes()


def route(pool: str, job_id: str) -> dict[str, Any]:
    """Where `job_id`'s messages to `pool` go: its tenant's lane (`queue`), at its priority
    (`priority`; None for the default, 0, which kombu gives a message that has none)."""
    lane, priority, _ = _lanes.of_job(job_id)
    return {"queue": lane_queue(pool, lane), "priority": priority or None}


def tenant_gate(job_id: str) -> tuple[str, int] | None:
    """The gate of `job_id`'s tenant and its cap on actions in flight, if it has one (without
    any such cap configured, nothing is read)."""
    quotas = get_settings().quotas
    if not any(q.max_actions_in_flight for q in quotas.values()):
        return None
    tenant = _lanes.of_job(job_id)[2]
    quota = quotas.get(tenant)
    if quota is None or quota.max_actions_in_flight is None:
        return None
    return f"tenant:{tenant}", quota.max_actions_in_flight

