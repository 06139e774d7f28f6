"""Agents: `kind: Agent` manifests and the prompts their models read."""

from cortex_worker.agents.prompt import (
    PROTOCOL_REMINDER,
    build_system_prompt,
    format_errors,
    format_feeds,
    format_results,
    tool_functions,
)
from cortex_worker.agents.spec import (
    INTERNAL_ACTIONS,
    AgentSpec,
    FeedSource,
    FeedSpec,
    InternalActionPolicy,
)

__all__ = [
    "INTERNAL_ACTIONS",
    "PROTOCOL_REMINDER",
    "AgentSpec",
    "FeedSource",
    "FeedSpec",
    "InternalActionPolicy",
    "build_system_prompt",
    "format_errors",
    "format_feeds",
    "format_results",
    "tool_functions",
]
