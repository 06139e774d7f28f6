"""The registry: the agents, tools, relics, workflows and model endpoints the manifests declare
(built-in tools and relics included)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from cortex_api.auth import require_key
from cortex_api.deps import SettingsDep, StoreDep
from cortex_api.errors import api_error, responses
from cortex_worker.actions.types.internal import INTERNAL_ACTIONS
from cortex_worker.agents.prompt import build_system_prompt
from cortex_worker.agents.spec import AgentSpec
from cortex_worker.handles import get_registry
from cortex_worker.llm.config import ModelConfig, ModelLimits
from cortex_worker.manifests.loader import Registry, UnknownModelError
from cortex_worker.plan.canvas import decompose
from cortex_worker.services.relics.spec import RelicSpec
from cortex_worker.tools.spec import Runtime, ToolSpec
from cortex_worker.workflows.spec import WorkflowSpec

T = TypeVar("T")

router = APIRouter(prefix="/v1", tags=["registry"], dependencies=[require_key])


def registry_dep() -> Registry:
    """The process's registry (tests override this dependency)."""
    return get_registry()


RegistryDep = Annotated[Registry, Depends(registry_dep)]


# -- response models ----------------------------------------------------------------------
class ModelView(BaseModel):
    """An agent's model endpoint: `base_url` as written (`${VAR}` unexpanded), never a key."""

    name: str | None = Field(default=None, description="the `kind: Model` it names (see "
                             "`GET /v1/models`); null: an inline block")
    provider: str
    model: str
    base_url: str
    native_tools: bool = False
    transcript: str | None = Field(default=None, description="replay: the transcript file")
    limits: ModelLimits | None = Field(default=None, description="the limits declared for the "
                                       "endpoint, shared by the cluster")


class AgentView(BaseModel):
    """An agent as listed."""

    name: str
    description: str
    model: ModelView
    tools: list[str]
    agents: list[str]
    max_turns: int
    system_prompt_chars: int = Field(
        description="length of the system prompt its model reads every turn (native tool "
                    "definitions, sent beside it, not counted)")


class AgentDetail(AgentView):
    """One agent: what it lists, plus its limits, feeds and permitted internal actions."""

    relics: list[str]
    workflows: list[str]
    context_feeds: list[str] = Field(description="ids of the declared context feeds")
    internal_actions: list[str] = Field(description="internal actions the model may call")
    max_wall_time_s: float
    max_actions: int
    max_depth: int
    system_prompt: str = Field(description="the system prompt, exactly as the model reads it")


class AgentList(BaseModel):
    """Every agent, sorted by name."""

    items: list[AgentView]


class ToolView(BaseModel):
    """A tool as listed: what it takes (a JSON Schema) and where it runs."""

    name: str
    description: str
    runtime: Runtime
    parameters: dict[str, Any]


class ToolDetail(ToolView):
    """One tool, with what it returns (documentation only) and its timeout."""

    returns: dict[str, Any] | None = None
    timeout: float | None = Field(default=None, description="seconds")


class ToolList(BaseModel):
    """Every tool, sorted by name (built-ins included)."""

    items: list[ToolView]


def _agent_fields(spec: AgentSpec, registry: Registry) -> dict[str, Any]:
    config = registry.model(spec.model)  # a ModelConfig once loaded (`model: NAME` linked)
    model = ModelView(name=config.name, provider=config.provider, model=config.model,
                      base_url=config.base_url,
                      native_tools=config.native_tools, transcript=config.transcript,
                      limits=config.limits)
    return {"name": spec.name, "description": spec.description, "model": model,
            "tools": list(spec.tools), "agents": list(spec.agents), "max_turns": spec.max_turns,
            "system_prompt_chars": len(build_system_prompt(spec, registry))}


def _tool_fields(spec: ToolSpec) -> dict[str, Any]:
    return {"name": spec.name, "description": spec.description, "runtime": spec.runtime,
            "parameters": spec.parameters}


def _find(table: Mapping[str, T], kind: str, name: str) -> T:
    """The manifest of this kind and name, or 404 listing the known names."""
    spec = table.get(name)
    if spec is None:
        raise api_error(404, f"{kind} {name!r} not found", known=sorted(table))
    return spec


# -- routes -------------------------------------------------------------------------------
@router.get("/agents", response_model=AgentList)
def list_agents(registry: RegistryDep) -> AgentList:
    """The agents of the manifests, sorted by name."""
    return AgentList(items=[AgentView(**_agent_fields(registry.agents[name], registry))
                            for name in sorted(registry.agents)])


@router.get("/agents/{name}", response_model=AgentDetail, responses=responses(404))
def get_agent(name: str, registry: RegistryDep) -> AgentDetail:
    """One agent; 404 if no manifest declares it."""
    spec = _find(registry.agents, "agent", name)
    policy = spec.internal_actions
    return AgentDetail(
        **_agent_fields(spec, registry),
        relics=list(spec.relics),
        workflows=list(spec.workflows),
        context_feeds=[feed.id for feed in spec.context_feeds],
        internal_actions=[action for action in INTERNAL_ACTIONS if policy.permits(action)],
        max_wall_time_s=spec.max_wall_time_s,
        max_actions=spec.max_actions,
        max_depth=spec.max_depth,
        system_prompt=build_system_prompt(spec, registry),
    )


@router.get("/tools", response_model=ToolList)
def list_tools(registry: RegistryDep) -> ToolList:
    """The tools (built-in and from the manifests), sorted by name."""
    return ToolList(items=[ToolView(**_tool_fields(registry.tools[name]))
                           for name in sorted(registry.tools)])


@router.get("/tools/{name}", response_model=ToolDetail, responses=responses(404))
def get_tool(name: str, registry: RegistryDep) -> ToolDetail:
    """One tool; 404 if it is neither built in nor declared."""
    spec = _find(registry.tools, "tool", name)
    return ToolDetail(**_tool_fields(spec), returns=spec.returns, timeout=spec.timeout)


# -- relics -------------------------------------------------------------------------------
class OperationView(BaseModel):
    """One operation of a relic: what it takes (a JSON Schema); method and path for http."""

    description: str
    method: str | None = Field(default=None, description="http relics only")
    path: str | None = Field(default=None, description="http relics only")
    parameters: dict[str, Any]


class RelicView(BaseModel):
    """A relic: a long-lived service with named operations (built-in or http)."""

    name: str
    description: str
    runtime: str
    builtin: bool
    idle_timeout_s: float
    operations: dict[str, OperationView]


class RelicList(BaseModel):
    """Every relic, sorted by name (built-ins included)."""

    items: list[RelicView]


def _relic_view(spec: RelicSpec) -> RelicView:
    http = spec.runtime == "http"
    return RelicView(
        name=spec.name, description=spec.description, runtime=spec.runtime,
        builtin=not http, idle_timeout_s=spec.idle_timeout_s,
        operations={name: OperationView(description=op.description,
                                        method=op.method if http else None,
                                        path=op.path if http else None,
                                        parameters=op.parameters)
                    for name, op in sorted(spec.operations.items())})


@router.get("/relics", response_model=RelicList)
def list_relics(registry: RegistryDep) -> RelicList:
    """The relics (built-in and from the manifests), sorted by name."""
    return RelicList(items=[_relic_view(registry.relics[name]) for name in sorted(registry.relics)])


@router.get("/relics/{name}", response_model=RelicView, responses=responses(404))
def get_relic(name: str, registry: RegistryDep) -> RelicView:
    """One relic; 404 if it is neither built in nor declared."""
    spec = _find(registry.relics, "relic", name)
    return _relic_view(spec)


# -- workflows ----------------------------------------------------------------------------
class WorkflowStepView(BaseModel):
    """One step: what it runs and what it waits for (explicit and `$reference` dependencies)."""

    id: str
    type: str
    name: str
    depends_on: list[str]
    output_key: str | None = None


class WorkflowView(BaseModel):
    """A workflow: its inputs (a JSON Schema), its steps, and its output expression."""

    name: str
    description: str
    inputs: dict[str, Any]
    steps: list[WorkflowStepView]
    output: Any = Field(default=None, description="null: the last step's value")


class WorkflowDetail(WorkflowView):
    """One workflow, with its plan: waves and canvas shape (null: not series-parallel)."""

    waves: list[list[str]]
    canvas: Any = None


class WorkflowList(BaseModel):
    """Every workflow, sorted by name."""

    items: list[WorkflowView]


def _workflow_fields(spec: WorkflowSpec) -> dict[str, Any]:
    plan = spec.plan()
    steps = [WorkflowStepView(id=s.id, type=s.type, name=s.name, output_key=s.output_key,
                              depends_on=list(plan.nodes[s.id].depends_on)) for s in spec.steps]
    return {"name": spec.name, "description": spec.description, "inputs": spec.inputs,
            "steps": steps, "output": spec.output}


@router.get("/workflows", response_model=WorkflowList)
def list_workflows(registry: RegistryDep) -> WorkflowList:
    """The workflows of the manifests, sorted by name."""
    return WorkflowList(items=[WorkflowView(**_workflow_fields(registry.workflows[name]))
                               for name in sorted(registry.workflows)])


@router.get("/workflows/{name}", response_model=WorkflowDetail, responses=responses(404))
def get_workflow(name: str, registry: RegistryDep) -> WorkflowDetail:
    """One workflow; 404 if no manifest declares it."""
    spec = _find(registry.workflows, "workflow", name)
    step = decompose(spec.plan())
    return WorkflowDetail(**_workflow_fields(spec), waves=spec.plan().waves(),
                          canvas=step.shape() if step is not None else None)


# -- model endpoints ----------------------------------------------------------------------
class ModelUse(BaseModel):
    """What an endpoint uses now, counted in Redis by every worker (`Store.model_use`)."""

    in_flight: int = Field(description="requests in flight now")
    waiting: int = Field(description="requests waiting for a slot now")
    paused_for_s: float = Field(description="seconds left of the pause a 429 (or 529) started "
                                "for every worker; 0: none")
    adaptive_max_concurrent: int | None = Field(
        description="requests allowed in flight since a 429: halved at each one, grown back "
                    "by successes; null: not lowered")
    requests: int = Field(description="requests sent so far")
    rate_limited: int = Field(description="of them, answered 429 or 529")
    waits: int = Field(description="times a request waited for a slot")


class ModelEndpointView(BaseModel):
    """A model endpoint: a `kind: Model`, or an inline `model:` block that declares `limits`.
    `base_url` as written (`${VAR}` unexpanded), never a key."""

    name: str = Field(description="the Model's name; for an inline block `inline-<hash>` "
                      "(what its limits are kept under)")
    declared: Literal["Model", "inline"] = Field(
        description="`Model`: a `kind: Model` manifest; `inline`: the `model:` block of "
                    "agents, workflows or `CORTEX_DOCUMENT_MODEL`")
    description: str = ""
    provider: str
    base_url: str
    model: str = Field(description="the model name sent to the provider")
    limits: ModelLimits | None = Field(description="the declared limits; null: none (a 429's "
                                       "reset still pauses every worker)")
    agents: list[str] = Field(description="the agents that use it, sorted")
    workflows: list[str] = Field(description="the workflows whose `llm` steps use it, sorted")
    documents: bool = Field(description="documents' `llm` actions use it "
                            "(`CORTEX_DOCUMENT_MODEL`)")
    use: ModelUse


class ModelList(BaseModel):
    """The `kind: Model` endpoints sorted by name, then the inline ones with `limits`."""

    items: list[ModelEndpointView]


class _Endpoint:
    """One endpoint being listed: its config, description and users by section."""

    def __init__(self, config: ModelConfig, description: str = "") -> None:
        self.config, self.description = config, description
        self.users: dict[str, list[str]] = {"agents": [], "workflows": [], "documents": []}


def _endpoints(registry: Registry, document_model: ModelConfig | str | None
               ) -> dict[str, _Endpoint]:
    """Every endpoint to list, by `endpoint()`: the kind: Model ones, sorted, then the inline
    blocks that declare limits, sorted (an inline block is listed with the first limits its
    users declare, and with every user of the same block, limits declared or not)."""
    users: list[tuple[str, str, ModelConfig]] = []
    for section, user, model in [
            *(("agents", name, spec.model) for name, spec in sorted(registry.agents.items())),
            *(("workflows", name, spec.model) for name, spec in sorted(registry.workflows.items())),
            ("documents", "documents", document_model)]:
        if model is None:
            continue
        try:
            users.append((section, user, registry.model(model)))
        except UnknownModelError:  # checked when the manifests load; nothing to list here
            continue
    found = {name: _Endpoint(spec.config(), spec.description)
             for name, spec in sorted(registry.models.items())}
    inline: dict[str, _Endpoint] = {}
    for _, _, config in users:
        if config.name is None and config.limits is not None:
            inline.setdefault(config.endpoint(), _Endpoint(config))
    found.update(sorted(inline.items()))
    for section, user, config in users:
        entry = found.get(config.endpoint())
        if entry is not None:
            entry.users[section].append(user)
    return found


@router.get("/models", response_model=ModelList)
def list_models(registry: RegistryDep, store: StoreDep, settings: SettingsDep) -> ModelList:
    """The model endpoints, with their limits and live use across the cluster.

    Each `kind: Model`, sorted by name, then each inline `model:` block that declares
    `limits` (named `inline-<hash>`), with what uses it (agents, workflows, documents), and
    what it uses now: requests in flight and waiting, the pause a 429 started, the adaptive
    concurrency limit, and the requests, 429s and waits counted so far.
    """
    items = []
    for endpoint, entry in _endpoints(registry, settings.document_model).items():
        config = entry.config
        items.append(ModelEndpointView(
            name=endpoint, declared="inline" if config.name is None else "Model",
            description=entry.description, provider=config.provider, base_url=config.base_url,
            model=config.model, limits=config.limits, agents=entry.users["agents"],
            workflows=entry.users["workflows"], documents=bool(entry.users["documents"]),
            use=ModelUse(**store.model_use(endpoint))))
    return ModelList(items=items)
