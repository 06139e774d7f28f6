"""`GET /v1/usage`: a tenant's model usage over a range of days (jobs/usage.py counts it)."""

from __future__ import annotations

import datetime
from typing import Annotated

from fastapi import APIRouter, Query

from cortex_api.auth import CallerDep
from cortex_api.deps import StoreDep
from cortex_api.errors import api_error, responses
from cortex_api.models import UsageReport
from cortex_worker.jobs import usage

router = APIRouter(prefix="/v1", tags=["usage"])

MAX_DAYS = 400
"""The longest range one request may ask for (the counts are kept a little over a year)."""


def _day(value: str | None, name: str, default: datetime.date) -> datetime.date:
    if value is None:
        return default
    try:
        return datetime.date.fromisoformat(value)
    except ValueError:
        raise api_error(422, f"{name} must be a date like 2026-11-28, not {value!r}") from None


@router.get("/usage", response_model=UsageReport, response_model_by_alias=True,
            responses=responses(403, 422))
def get_usage(
    store: StoreDep,
    caller: CallerDep,
    tenant: Annotated[str | None, Query(description="the tenant (default: the caller's); "
                                        "with API keys, only the caller's own")] = None,
    start: Annotated[str | None, Query(alias="from", description="first UTC day, "
                                       "YYYY-MM-DD (default: the first of this month)")] = None,
    end: Annotated[str | None, Query(alias="to", description="last UTC day, included "
                                     "(default: today)")] = None,
) -> UsageReport:
    """Prompt tokens, completion tokens and requests of the tenant's jobs, by model endpoint
    and in all, over whole UTC days."""
    who = tenant or caller.tenant
    if not caller.owns(who):
        raise api_error(403, f"the caller's key is tenant {caller.tenant!r}'s: it may read "
                             f"only that tenant's usage, not {who!r}'s")
    today = datetime.datetime.now(datetime.UTC).date()
    first = _day(start, "from", today.replace(day=1))
    last = _day(end, "to", today)
    if last < first:
        raise api_error(422, f"to ({last}) is before from ({first})")
    if (last - first).days + 1 > MAX_DAYS:
        raise api_error(422, f"a range covers at most {MAX_DAYS} days")
    days = [(first + datetime.timedelta(days=n)).isoformat()
            for n in range((last - first).days + 1)]
    return UsageReport.model_validate(usage.totals(store, who, days))
