"""An agent's A2A Agent Card, built from its manifest: what an A2A client reads first."""

from __future__ import annotations

from a2a.types.a2a_pb2 import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentProvider,
    AgentSkill,
    APIKeySecurityScheme,
    HTTPAuthSecurityScheme,
    SecurityRequirement,
    SecurityScheme,
    StringList,
)
from a2a.utils.constants import PROTOCOL_VERSION_1_0, TransportProtocol

from cortex_worker.agents.spec import AgentSpec
from cortex_worker.manifests.loader import Registry

TEXT = "text/plain"
#: The security schemes of a card when API keys are configured (docs/security.md).
BEARER, API_KEY = "bearer", "apiKey"


def _skills(spec: AgentSpec, registry: Registry) -> list[AgentSkill]:
    """The agent itself, then each tool, agent and workflow its manifest lets it use: what a
    client may ask it for."""
    uses = [*spec.tools, *spec.agents, *spec.workflows]
    skills = [AgentSkill(id=spec.name, name=spec.name,
                         description=spec.description or f"the Cortex agent {spec.name}",
                         tags=["cortex", "agent", *uses])]
    for kind, names, table in (("tool", spec.tools, registry.tools),
                               ("agent", spec.agents, registry.agents),
                               ("workflow", spec.workflows, registry.workflows)):
        for name in names:
            described = getattr(table.get(name), "description", "") or f"the {kind} {name}"
            skills.append(AgentSkill(id=f"{kind}:{name}", name=name, description=described,
                                     tags=[kind, name]))
    return skills


def agent_card(spec: AgentSpec, registry: Registry, *, rpc_url: str, provider_url: str,
               version: str, keys: bool) -> AgentCard:
    """The card of `spec` served at `rpc_url` (JSON-RPC, A2A 1.0). With API keys configured
    (`keys`) it declares them: a bearer token, or the same key in `X-API-Key`."""
    card = AgentCard(
        name=spec.name,
        description=spec.description or f"the Cortex agent {spec.name}",
        supported_interfaces=[AgentInterface(url=rpc_url,
                                             protocol_binding=TransportProtocol.JSONRPC.value,
                                             protocol_version=PROTOCOL_VERSION_1_0)],
        provider=AgentProvider(organization="Cortex", url=provider_url),
        version=version,
        capabilities=AgentCapabilities(streaming=True, push_notifications=False,
                                       extended_agent_card=False),
        default_input_modes=[TEXT, "application/json"],
        default_output_modes=[TEXT],
        skills=_skills(spec, registry),
    )
    if keys:
        card.security_schemes[BEARER].CopyFrom(SecurityScheme(
            http_auth_security_scheme=HTTPAuthSecurityScheme(
                scheme="Bearer", description="a Cortex API key as the bearer token")))
        card.security_schemes[API_KEY].CopyFrom(SecurityScheme(
            api_key_security_scheme=APIKeySecurityScheme(
                location="header", name="X-API-Key", description="a Cortex API key")))
        for scheme in (BEARER, API_KEY):  # either one: each requirement is an alternative
            requirement = SecurityRequirement()
            requirement.schemes[scheme].CopyFrom(StringList())
            card.security_requirements.append(requirement)
    return card
