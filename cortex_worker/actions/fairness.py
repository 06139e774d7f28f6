"""Fair by tenant (architecture.md: "each pool takes their work in turn").

Celery queues are FIFO: one tenant's backlog would sit in front of everyone's work. So each
pool's queue is split in lanes (`pools.LANES`), and every tenant's messages go to its own lane
(given once, in Redis, to the lane with the fewest tenants: while there are no more tenants
than lanes, each has one alone). A worker consumes all the lanes of its pool, and kombu's Redis
transport takes from them in turn (it moves the lane it just took from to the end of its
`BRPOP`), so with several tenants waiting each gets every n-th free slot, and a tenant alone
gets the whole pool. A redelivered message, a canvas step and a retried task stay in their
lane: its name is the message's routing key.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from cortex_worker.handles import get_store
from cortex_worker.jobs.record import DEFAULT_TENANT, JobRecord
from cortex_worker.pools import LANES, lane_queue

JOBS_REMEMBERED = 65536
"""Jobs whose lane this process remembers (a job's tenant never changes)."""


class _Lanes:
    """This process's memory of each tenant's lane and each job's lane. Never wrong, only
    late: a lane given in another Redis (a test's) is still a lane every worker consumes."""

    def __init__(self) -> None:
        self.tenants: dict[str, int] = {DEFAULT_TENANT: 0}
        self.jobs: OrderedDict[str, int] = OrderedDict()
        self.lock = threading.Lock()

    def of_tenant(self, tenant: str) -> int:
        lane = self.tenants.get(tenant)
        if lane is None:
            lane = get_store().tenant_lane(tenant, LANES)
            self.tenants[tenant] = lane
        return lane

    def of_job(self, job_id: str) -> int:
        with self.lock:
            lane = self.jobs.get(job_id)
            if lane is not None:
                self.jobs.move_to_end(job_id)
                return lane
        record = get_store().peek(job_id, "tenant") or JobRecord(id=job_id)
        lane = self.of_tenant(record.tenant)
        with self.lock:
            self.jobs[job_id] = lane
            while len(self.jobs) > JOBS_REMEMBERED:
                self.jobs.popitem(last=False)
        return lane


_lanes = _Lanes()


def queue(pool: str, job_id: str) -> str:
    """The queue of `pool` that `job_id`'s messages go to: its tenant's lane."""
    return lane_queue(pool, _lanes.of_job(job_id))

