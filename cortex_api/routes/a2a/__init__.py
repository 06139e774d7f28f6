"""A2A 1.0 (Agent2Agent): each agent is an A2A server, a thin adapter over the job model.

`GET /v1/a2a/{name}/.well-known/agent-card.json` is its card; `POST /v1/a2a/{name}` its
JSON-RPC endpoint, dispatched by the official `a2a-sdk`'s `JsonRpcDispatcher` (method routing,
`A2A-Version` checks, errors, SSE) to `JobTasks`, whose tasks are Cortex jobs and whose
contexts are Cortex sessions. API keys and tenants apply as on every `/v1` route.
"""

from __future__ import annotations

from a2a.server.request_handlers.response_helpers import agent_card_to_dict
from a2a.server.routes.jsonrpc_dispatcher import JsonRpcDispatcher
from a2a.utils.constants import PROTOCOL_VERSION_CURRENT, VERSION_HEADER
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from cortex_api.auth import CallerDep, require_key
from cortex_api.deps import HubDep, SettingsDep, StoreDep
from cortex_api.errors import api_error, responses
from cortex_api.routes.a2a.card import agent_card
from cortex_api.routes.a2a.handler import JobTasks, Scope
from cortex_worker.agents.spec import AgentSpec
from cortex_worker.handles import get_registry
from cortex_worker.manifests.loader import UnknownAgentError

router = APIRouter(prefix="/v1/a2a", tags=["a2a"])


def _agent(name: str) -> AgentSpec:
    try:
        return get_registry().agent(name)
    except UnknownAgentError as exc:
        raise api_error(404, str(exc)) from None


@router.get("/{name}/.well-known/agent-card.json", dependencies=[require_key],
            responses=responses(404))
def card(name: str, request: Request) -> JSONResponse:
    """The agent's A2A Agent Card: its skills (from its manifest), streaming, the JSON-RPC
    URL, and the API keys as security schemes when keys are configured."""
    built = agent_card(_agent(name), get_registry(),
                       rpc_url=str(request.url_for("a2a_rpc", name=name)),
                       provider_url=str(request.base_url), version=request.app.version,
                       keys=bool(request.app.state.keyring))
    return JSONResponse(agent_card_to_dict(built))


@router.post("/{name}", name="a2a_rpc", responses=responses(404))
async def rpc(name: str, request: Request, caller: CallerDep, store: StoreDep, hub: HubDep,
              settings: SettingsDep) -> Response:
    """A2A JSON-RPC 2.0: `SendMessage`, `SendStreamingMessage` (SSE), `GetTask`,
    `CancelTask`, `SubscribeToTask` (SSE). Send `A2A-Version: 1.0`; the answer carries it."""
    _agent(name)
    handler = JobTasks(Scope(name, caller, store, hub, settings))
    response = await JsonRpcDispatcher(handler).handle_requests(request)
    response.headers[VERSION_HEADER] = PROTOCOL_VERSION_CURRENT
    return response
