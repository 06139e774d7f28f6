"""Jobs: create from a protocol document, read, list, cancel, and stream their events."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response

from cortex_api.auth import Caller, CallerDep, StreamCallerDep
from cortex_api.deps import REPLAYED, HubDep, IdempotencyKey, SettingsDep, StoreDep
from cortex_api.errors import api_error, job_not_found, responses, submitting
from cortex_api.limits import check_document_size
from cortex_api.models import (
    ApprovalAnswer,
    ApprovalDecision,
    JobCreate,
    JobCreated,
    JobLinks,
    JobList,
    JobStatus,
    JobStatusView,
    JobSummary,
    JobView,
)
from cortex_api.sse import (
    STREAM_FORMATS,
    EventStreamResponse,
    agui_encoder,
    event_stream,
    resume_point,
)
from cortex_worker.errors import AlreadySubmitted
from cortex_worker.jobs import usage
from cortex_worker.jobs.lifecycle import (
    Once,
    cancel_job,
    decide_approval,
    submit_agent,
    submit_document,
    submit_workflow,
)
from cortex_worker.jobs.record import JobRecord
from cortex_worker.store.keys import job_keys
from cortex_worker.store.state import Store

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

SUMMARY_FIELDS = ("status", "kind", "agent", "created_at", "started_at", "finished_at", "error")
SCAN_BATCH = 200
MAX_SCAN = 5000


@router.post("", status_code=202, response_model=JobCreated, responses=responses(413, 422))
def create_job(body: JobCreate, request: Request, response: Response, store: StoreDep,
               settings: SettingsDep, caller: CallerDep,
               idempotency_key: IdempotencyKey = None) -> JobCreated:
    """Queue a job: a protocol document, an agent on an input, or a workflow on its inputs.
    422 explains a rejection. With an `Idempotency-Key`, the same request sent again answers
    with the job the first made (`Idempotent-Replayed: true`) and makes no other; the same
    key with another request is a 422."""
    # SubmitError and UnknownAgentError become that 422 in cortex_api.errors.cortex_error
    once = Once.of(idempotency_key, body.model_dump(mode="json")) if idempotency_key else None
    try:
        if body.agent is not None:
            job_id = submit_agent(store, body.agent, body.input or "", options=body.options,
                                  tenant=caller.tenant, once=once)
        elif body.workflow is not None:
            submitting(request, "workflow")
            job_id = submit_workflow(store, body.workflow, body.inputs, options=body.options,
                                     tenant=caller.tenant, once=once)
        else:
            assert body.protocol is not None
            check_document_size(body.protocol, settings)
            submitting(request, "document")
            job_id = submit_document(store, body.protocol, options=body.options,
                                     tenant=caller.tenant, once=once)
    except AlreadySubmitted as exc:
        job_id = exc.job_id
        response.headers[REPLAYED] = "true"
    links = _links(request, job_id)
    response.headers["Location"] = links.self
    return JobCreated(id=job_id, status=_status(store, job_id) or "queued", links=links)


@router.get("", response_model=JobList)
def list_jobs(
    store: StoreDep,
    caller: CallerDep,
    status: Annotated[JobStatus | None, Query(description="only jobs in this status")] = None,
    agent: Annotated[str | None, Query(description="only jobs of this agent")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    offset: Annotated[int, Query(ge=0, description="position in the job index, newest first; "
                                                    "pass `next_offset` to page")] = 0,
) -> JobList:
    """The caller's jobs, newest first; with `status` or `agent`, only those that match.
    Each with its kind, agent and action counts."""
    items, next_offset = _page(store, status, agent, limit, offset, caller.index)
    return JobList(items=items, limit=limit, offset=offset, next_offset=next_offset)


@router.get("/{job_id}", response_model=JobView, responses=responses(404))
def get_job(job_id: str, store: StoreDep, caller: CallerDep) -> JobView:
    """A job, its actions (in document order) and their outcomes."""
    job = store.get_job(job_id)
    if job is None or not caller.owns(job.tenant):
        raise job_not_found(job_id)
    return JobView.from_store(job, store.actions(job_id), usage.job_usage(store, job_id))


@router.post("/{job_id}/cancel", response_model=JobStatusView, responses=responses(404, 409))
def cancel(job_id: str, store: StoreDep, caller: CallerDep) -> JobStatusView:
    """Cancel a job: its queued and running actions are revoked. 409 if it had already ended."""
    job = store.peek(job_id, "status", "tenant")
    if job is None or not caller.owns(job.tenant):
        raise job_not_found(job_id)
    if not cancel_job(store, job_id):
        status = _status(store, job_id) or "unknown"
        raise api_error(409, f"job {job_id!r} has already ended ({status})", status=status)
    return JobStatusView(id=job_id, status=_status(store, job_id) or "cancelled")


@router.post("/{job_id}/actions/{action_id}/approve", response_model=ApprovalDecision,
             responses=responses(404, 409))
def approve(job_id: str, action_id: str, store: StoreDep, caller: CallerDep,
            body: ApprovalAnswer | None = None) -> ApprovalDecision:
    """Approve an action that awaits approval: it is sent to its pool. 409 if it does not
    await approval (any more)."""
    return _decide(store, caller, job_id, action_id, True, body or ApprovalAnswer())


@router.post("/{job_id}/actions/{action_id}/reject", response_model=ApprovalDecision,
             responses=responses(404, 409))
def reject(job_id: str, action_id: str, store: StoreDep, caller: CallerDep,
           body: ApprovalAnswer | None = None) -> ApprovalDecision:
    """Reject an action that awaits approval: it fails with the reason, which the model
    reads as its error. 409 if it does not await approval (any more)."""
    return _decide(store, caller, job_id, action_id, False, body or ApprovalAnswer())


def _decide(store: Store, caller: Caller, job_id: str, action_id: str, approve: bool,
            answer: ApprovalAnswer) -> ApprovalDecision:
    job = store.peek(job_id, "status", "tenant")
    if job is None or not caller.owns(job.tenant):
        raise job_not_found(job_id)
    if store.spec(job_id, action_id) is None:
        raise api_error(404, f"job {job_id!r} has no action {action_id!r}")
    outcome = decide_approval(store, job_id, action_id, approve=approve,
                              by=f"tenant {caller.tenant}" if caller.enforced else "api",
                              reason=answer.reason)
    if outcome == "approved" or outcome == "rejected":
        return ApprovalDecision(job_id=job_id, action_id=action_id, decision=outcome)
    why = {"none": "it does not require approval, or is not ready yet",
           "ended": f"the job has ended ({_status(store, job_id)})"}.get(
               outcome, f"it was already {outcome.removeprefix('was_')}")
    raise api_error(409, f"action {action_id!r} of job {job_id!r} does not await approval: {why}",
                    state=outcome)


@router.get("/{job_id}/events", status_code=200, response_class=EventStreamResponse,
            responses={200: {"content": {"text/event-stream": {}},
                             "description": "`id: <seq>`, `event: <type>`, `data: <event JSON>`; "
                                            "with `format=ag-ui`, one message `id: <seq>`, "
                                            "`data: <AG-UI event JSON>` per AG-UI event"},
                       **responses(400, 404)})
async def job_events(
    job_id: str,
    hub: HubDep,
    caller: StreamCallerDep,
    after: Annotated[int, Query(ge=0, description="send events with seq > after")] = 0,
    last_event_id: Annotated[str | None, Header(description="resume after this seq")] = None,
    fmt: Annotated[str, Query(alias="format", description="`cortex` (the events as logged) or "
                              "`ag-ui` ([AG-UI events](runtime.md#ag-ui))")] = "cortex",
) -> EventStreamResponse:
    """The job's events as server-sent events: replay, then live; ends after the last one."""
    if fmt not in STREAM_FORMATS:
        raise api_error(400, f"unknown format {fmt!r}: use one of "
                             f"{', '.join(STREAM_FORMATS)}", formats=list(STREAM_FORMATS))
    try:
        start = resume_point(last_event_id, after)
    except ValueError as exc:
        raise api_error(400, str(exc)) from None
    status, tenant = await hub.status_and_tenant(job_id)
    if status is None or not caller.owns(tenant):
        raise job_not_found(job_id)
    if fmt == "ag-ui":
        encode = await agui_encoder(hub, job_id, start, thread_id=await hub.session(job_id))
        return EventStreamResponse(event_stream(hub, job_id, start, encode=encode))
    return EventStreamResponse(event_stream(hub, job_id, start))


def _status(store: Store, job_id: str) -> str | None:
    """Just the status (the job hash also holds the whole document)."""
    job = store.peek(job_id, "status")
    return None if job is None else job.status


def _links(request: Request, job_id: str) -> JobLinks:
    return JobLinks.for_job(job_id)


def _page(store: Store, status: JobStatus | None, agent: str | None, limit: int, offset: int,
          tenant: str | None = None) -> tuple[list[JobSummary], int | None]:
    """Walk the job index (`tenant`'s, or the global one) from `offset`; expired jobs are
    skipped. Returns items, next offset."""
    found: list[JobRecord] = []
    position = offset
    more = True
    while more and len(found) < limit and position - offset < MAX_SCAN:
        batch = limit - len(found) if status is None and agent is None else SCAN_BATCH
        ids = store.list_jobs(limit=batch, offset=position, tenant=tenant)
        more = bool(ids)
        for job in store.peek_many(ids, *SUMMARY_FIELDS):
            position += 1
            if job is None or (status is not None and job.status != status.value) \
                    or (agent is not None and job.agent != agent):
                continue
            found.append(job)
            if len(found) == limit:
                break
    more = more and bool(store.list_jobs(limit=1, offset=position, tenant=tenant))
    items = [JobSummary.from_store(job, statuses)
             for job, statuses in zip(found, _action_statuses(store, found), strict=True)]
    return items, position if more else None


def _action_statuses(store: Store, jobs: list[JobRecord]) -> list[list[str]]:
    """Each job's action statuses, for a page's counts: one round trip for the page."""
    pipe = store.redis.pipeline(transaction=False)
    for job in jobs:
        pipe.hvals(job_keys(job.id).status)
    return pipe.execute()
