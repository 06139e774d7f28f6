"""`kind: Agent` manifests."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cortex_worker.actions.table import FEED_SOURCES
from cortex_worker.actions.types.internal import INTERNAL_ACTIONS
from cortex_worker.agents import output
from cortex_worker.llm.config import ModelConfig, ModelField

FeedSourceType = Literal[FEED_SOURCES]
"""The action types a context feed may take its values from (`actions.table`)."""


class InternalActionPolicy(BaseModel):
    """Which internal actions a model may call (protocol.md §6)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    allowed: list[str] = Field(default_factory=lambda: list(INTERNAL_ACTIONS))
    blocked: list[str] = Field(default_factory=list)

    def permits(self, name: str) -> bool:
        return self.enabled and name in self.allowed and name not in self.blocked


class ApprovalPolicy(BaseModel):
    """Which of an agent's actions wait for a person's approval, and for how long."""

    model_config = ConfigDict(extra="forbid")

    require: list[str] = Field(default_factory=list, description="names of the targets whose "
                               "actions need approval (tools, agents, relics, workflows, "
                               "internal actions); `*`: every action")
    timeout_s: float | None = Field(default=None, gt=0, description="an unanswered request is "
                                    "rejected after this long (default: the setting "
                                    "approval_timeout_s)")

    def requires(self, name: str) -> bool:
        return "*" in self.require or name in self.require


class FeedSource(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: FeedSourceType
    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class FeedSpec(BaseModel):
    """A context feed declared by an agent (computed by the runtime, shown in prompts)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["on_demand", "periodic"] = "on_demand"
    source: FeedSource
    interval: float | None = Field(default=None, gt=0)
    cache_ttl: float | None = Field(default=None, ge=0, description="seconds (0: no cache); "
                                    "shared by the jobs of the agent (and tenant)")
    max_tokens: int | None = Field(default=None, gt=0)
    enabled: bool = True


class AgentSpec(BaseModel):
    """An agent: its model, its instructions, and what it may use."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["Agent"] = "Agent"
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_\-]*$")
    description: str = ""
    model: ModelField = Field(
        default_factory=ModelConfig,
        description="an inline block, or the name of a `kind: Model`: the loader puts the "
                    "Model's `ModelConfig` in its place, so a loaded agent's is always one")
    system_prompt: str = Field(default="", description="instructions, inline")
    system_prompt_file: str | None = Field(default=None,
                                           description="instructions from a file, relative to the manifest")
    tools: list[str] = Field(default_factory=list)
    agents: list[str] = Field(default_factory=list)
    relics: list[str] = Field(default_factory=list)
    workflows: list[str] = Field(default_factory=list)
    max_turns: int = Field(default=10, gt=0, le=1000)
    max_wall_time_s: float = Field(default=600.0, gt=0)
    max_actions: int = Field(default=200, gt=0)
    max_depth: int = Field(default=3, ge=0, le=20, description="nesting of agent actions")
    context_feeds: list[FeedSpec] = Field(default_factory=list)
    internal_actions: InternalActionPolicy = Field(default_factory=InternalActionPolicy)
    approval: ApprovalPolicy = Field(default_factory=ApprovalPolicy)
    output_schema: dict[str, Any] | str | None = Field(
        default=None, description="the final response's JSON Schema (or a pydantic model of a "
        "tool module, module:Class, turned into its schema at load): the job's result is the "
        "parsed value; a final response that does not match is refused and the model told why")

    @field_validator("output_schema")
    @classmethod
    def _output_schema(cls, value: dict[str, Any] | str | None) -> dict[str, Any] | str | None:
        """A schema is checked here; a model's name when the manifests are linked."""
        if isinstance(value, dict):
            return output.resolve(value)
        if isinstance(value, str) and ":" not in value:
            raise ValueError(f"{value!r}: name a pydantic model as module:Class, or give a "
                             "JSON Schema object")
        return value
