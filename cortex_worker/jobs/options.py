"""Per-job options (`POST /v1/jobs`), parsed once at submit and read by every job kind."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class ClientTool(BaseModel):
    """A tool the job's client runs itself (an AG-UI frontend tool): offered to the model like
    the agent's own tools; a call to one waits, like an approval, for the client's answer,
    which becomes its result. Cortex never runs it."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z_][A-Za-z0-9_\-]*$",
                      description="unique among the agent's tools and the job's client tools")
    description: str = Field(default="", max_length=4000)
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="the call's parameters, as JSON Schema")


class JobOptions(BaseModel):
    """Per-job options of `POST /v1/jobs`."""

    fail_fast: bool = Field(default=False, description="cancel the job at the first failure")
    max_parallel: int | None = Field(default=None, gt=0, le=10_000,
                                     description="running actions at once (default from settings)")
    canvas: bool | None = Field(default=None,
                                description="compile series-parallel plans to a Celery canvas")
    priority: int = Field(default=0, ge=0, le=9, description="0 (the default) to 9: of a "
                          "tenant's waiting work, a job with a higher number waits behind its "
                          "lower ones (background work); other tenants' turns come as they "
                          "would")
    model: str | None = Field(default=None, max_length=200,
                              description="use this model name instead of the agent manifest's "
                              "(documents: instead of CORTEX_DOCUMENT_MODEL's)")
    client_tools: list[ClientTool] = Field(
        default_factory=list, max_length=128,
        description="agent jobs: tools the client runs itself (AG-UI frontend tools, "
                    "answered by the next run's tool messages); a call to one waits for the "
                    "client's result like an approval, and expires like one")

    def client_tool_names(self) -> list[str]:
        """The names of the client tools, in order."""
        return [tool.name for tool in self.client_tools]
