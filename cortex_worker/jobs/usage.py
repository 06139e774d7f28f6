"""What jobs spend on models, and the tenants' budgets (issue: usage and quotas).

Each answered model request is counted (`record`) against its job (`Store.usage` of the job's
`usage` key: the job view and its end event show it) and against its tenant's UTC day and
month (`usage_key`), per model endpoint: prompt tokens, completion tokens, requests. A tenant's
budget (`Settings.quotas`: tokens per day and per month) is checked when a job is submitted
(`check_submit`: the API answers 429) and before each model request (`check_running`: the job
ends `failed` with `quota_exceeded`).
"""

from __future__ import annotations

import time
from typing import Any

from cortex_worker.errors import QuotaExceededError
from cortex_worker.llm.stream import ModelError
from cortex_worker.settings import Quota, get_settings
from cortex_worker.store.keys import job_keys, usage_key
from cortex_worker.store.state import Store

USAGE_TTL_S = 400 * 86400
"""A tenant's day and month counts are kept a little over a year."""


class QuotaExceeded(ModelError):
    """The tenant ran out of budget while a job ran: the job ends `failed` with this."""


def periods(now: float | None = None) -> tuple[str, str]:
    """The UTC day and month a request counts in."""
    moment = time.gmtime(now)
    return time.strftime("%Y-%m-%d", moment), time.strftime("%Y-%m", moment)


def record(store: Store, job_id: str, tenant: str, endpoint: str, prompt_tokens: int,
           completion_tokens: int) -> None:
    store.record_usage(job_id, tenant, endpoint, prompt_tokens=prompt_tokens,
                       completion_tokens=completion_tokens, days=periods(), ttl_s=USAGE_TTL_S)


def job_usage(store: Store, job_id: str) -> dict[str, dict[str, int]]:
    """The job's usage per model endpoint: {endpoint: {prompt_tokens, completion_tokens,
    requests}} (empty: it made no model request)."""
    return store.usage(job_keys(job_id).usage)


def over_budget(store: Store, tenant: str) -> str | None:
    """Why `tenant` may not spend more tokens now (its day's or month's budget is spent), or
    None (no budget, or some left)."""
    quota: Quota | None = get_settings().quotas.get(tenant)
    if quota is None:
        return None
    day, month = periods()
    used_day, used_month = store.tokens_used(tenant, (day, month))
    if quota.tokens_per_day is not None and used_day >= quota.tokens_per_day:
        return (f"quota_exceeded: tenant {tenant!r} has used {used_day} of its "
                f"{quota.tokens_per_day} tokens for {day} (UTC); it renews at midnight UTC")
    if quota.tokens_per_month is not None and used_month >= quota.tokens_per_month:
        return (f"quota_exceeded: tenant {tenant!r} has used {used_month} of its "
                f"{quota.tokens_per_month} tokens for {month}; it renews on the 1st (UTC)")
    return None


def check_submit(store: Store, tenant: str) -> None:
    """Refuse a new job of a tenant whose budget is spent (HTTP 429)."""
    reason = over_budget(store, tenant)
    if reason is not None:
        raise QuotaExceededError(reason)


def check_running(store: Store, tenant: str) -> None:
    """Before a model request of a running job: its tenant's budget is not spent."""
    reason = over_budget(store, tenant)
    if reason is not None:
        raise QuotaExceeded(reason)


def totals(store: Store, tenant: str, days: list[str]) -> dict[str, Any]:
    """The tenant's usage over `days` (UTC dates): per endpoint, and all together."""
    endpoints: dict[str, dict[str, int]] = {}
    for day in days:
        for endpoint, counts in store.usage(usage_key(tenant, day)).items():
            into = endpoints.setdefault(endpoint, dict.fromkeys(counts, 0))
            for name, value in counts.items():
                into[name] = into.get(name, 0) + value
    whole = {name: sum(c.get(name, 0) for c in endpoints.values())
             for name in ("prompt_tokens", "completion_tokens", "requests")}
    return {"tenant": tenant, "from": days[0] if days else None,
            "to": days[-1] if days else None, "endpoints": endpoints, "total": whole}
