"""A tenant's cap on jobs running at once (`Settings.quotas[tenant].max_running_jobs`).

A queued job of a capped tenant starts only once it is admitted among the tenant's running
jobs (`Store.admit_running`, a set in Redis); until then its start task comes back every
`ADMIT_AGAIN_S` and the job stays `queued`. Its end releases its place (`release`); a place
whose release was lost (the process died between the two) is found by the next job that finds
the cap reached (`Store.prune_running`). Child jobs of a running job are not counted: their
parent, which waits for them, already is.
"""

from __future__ import annotations

from cortex_worker.jobs.record import JobRecord
from cortex_worker.settings import get_settings
from cortex_worker.store.state import Store

ADMIT_AGAIN_S = 1.0
"""How often a job held back by its tenant's cap asks again."""


def cap_of(tenant: str) -> int | None:
    quota = get_settings().quotas.get(tenant)
    return quota.max_running_jobs if quota is not None else None


def any_caps() -> bool:
    """Whether any tenant has a cap (without one, nothing here reads Redis)."""
    return any(q.max_running_jobs for q in get_settings().quotas.values())


def admitted(store: Store, job: JobRecord) -> bool:
    """Whether the queued `job` may start now."""
    cap = cap_of(job.tenant)
    if cap is None or job.parent_job:
        return True
    if store.admit_running(job.tenant, job.id, cap):
        return True
    return store.prune_running(job.tenant) > 0 and store.admit_running(job.tenant, job.id, cap)


def release(store: Store, job: JobRecord) -> None:
    """The job ended: its place among its tenant's running jobs is free."""
    if cap_of(job.tenant) is not None:
        store.release_running(job.tenant, job.id)
