"""Sessions: multi-turn conversations with an agent; each message starts a job."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Response

from cortex_api.auth import Caller, CallerDep
from cortex_api.deps import REPLAYED, IdempotencyKey, SettingsDep, StoreDep
from cortex_api.errors import api_error, responses
from cortex_api.models import JobCreated, JobLinks, MessageCreate, SessionCreate, SessionView
from cortex_worker.errors import AlreadySubmitted
from cortex_worker.handles import get_registry
from cortex_worker.jobs.lifecycle import Once, submit_agent
from cortex_worker.jobs.options import JobOptions
from cortex_worker.store.state import SessionTurn, Store

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])


def _view(data: dict) -> SessionView:
    return SessionView(id=data["id"], agent=data["agent"], created_at=float(data["created_at"]),
                       messages=data["messages"], jobs=data["jobs"])


@router.post("", status_code=201, response_model=SessionView, responses=responses(422))
def create_session(body: SessionCreate, store: StoreDep, settings: SettingsDep,
                   caller: CallerDep) -> SessionView:
    """Open a conversation with an agent."""
    get_registry().agent(body.agent)  # UnknownAgentError: 422 (cortex_api.errors)
    session_id = uuid.uuid4().hex
    store.create_session(session_id, body.agent, body.options.model_dump(), settings.event_retention_s,
                         tenant=caller.tenant)
    data = store.get_session(session_id)
    assert data is not None
    return _view(data)


@router.get("/{session_id}", response_model=SessionView, responses=responses(404))
def get_session(session_id: str, store: StoreDep, caller: CallerDep) -> SessionView:
    """The conversation so far and its jobs."""
    data = store.get_session(session_id)
    if data is None or not caller.owns(data.get("tenant")):
        raise api_error(404, f"no session {session_id!r}")
    return _view(data)


@router.post("/{session_id}/messages", status_code=202, response_model=JobCreated,
             responses=responses(404, 409, 422))
def post_message(session_id: str, body: MessageCreate, response: Response, store: StoreDep,
                 caller: CallerDep, idempotency_key: IdempotencyKey = None) -> JobCreated:
    """Send the next message: a job runs the agent with the conversation so far.
    With an `Idempotency-Key`, the same message sent again answers with the job the first
    made (`Idempotent-Replayed: true`), not 409."""
    once = Once.of(idempotency_key, {"session": session_id, **body.model_dump(mode="json")}) \
        if idempotency_key else None
    try:
        return send_message(session_id, body, store, caller, once)
    except AlreadySubmitted as exc:
        response.headers[REPLAYED] = "true"
        return JobCreated(id=exc.job_id, status=store.peek(exc.job_id, "status").status,
                          links=JobLinks.for_job(exc.job_id))


def send_message(session_id: str, body: MessageCreate, store: Store, caller: Caller,
                 once: Once | None = None) -> JobCreated:
    """The session's next message, from any entry point (the route, MCP, A2A): their checks
    are these. AlreadySubmitted if `once`'s request made its job already."""
    data = store.get_session(session_id)
    if data is None or not caller.owns(data.get("tenant")):
        raise api_error(404, f"no session {session_id!r}")
    history = [{"role": m["role"], "content": m["content"]} for m in data["messages"]]
    options = JobOptions.model_validate_json(data.get("options") or "{}")  # the session's
    # SessionBusy (409) if the last job is running, or another message came after this read
    after = SessionTurn(session_id, data["jobs"][-1] if data["jobs"] else None)
    job_id = submit_agent(store, data["agent"], body.content, options=options, history=history,
                          session=after, tenant=data.get("tenant") or caller.tenant, once=once)
    return JobCreated(id=job_id, status="queued", links=JobLinks.for_job(job_id))
