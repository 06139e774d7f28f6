"""Sessions: multi-turn conversations with an agent; each message starts a job."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request

from cortex_api.auth import CallerDep
from cortex_api.deps import SettingsDep, StoreDep
from cortex_api.errors import api_error, responses
from cortex_api.models import JobCreated, JobLinks, MessageCreate, SessionCreate, SessionView
from cortex_worker.handles import get_registry
from cortex_worker.jobs.lifecycle import submit_agent
from cortex_worker.jobs.options import JobOptions
from cortex_worker.store.state import SessionTurn

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
             responses=responses(404, 409))
def post_message(session_id: str, body: MessageCreate, request: Request, store: StoreDep,
                 caller: CallerDep) -> JobCreated:
    """Send the next message: a job runs the agent with the conversation so far."""
    data = store.get_session(session_id)
    if data is None or not caller.owns(data.get("tenant")):
        raise api_error(404, f"no session {session_id!r}")
    history = [{"role": m["role"], "content": m["content"]} for m in data["messages"]]
    options = JobOptions.model_validate_json(data.get("options") or "{}")  # the session's
    # SessionBusy (409) if the last job is running, or another message came after this read
    after = SessionTurn(session_id, data["jobs"][-1] if data["jobs"] else None)
    job_id = submit_agent(store, data["agent"], body.content, options=options, history=history,
                          session=after, tenant=data.get("tenant") or caller.tenant)
    return JobCreated(id=job_id, status="queued", links=JobLinks.for_job(job_id))
