"""Per-job options (`POST /v1/jobs`), parsed once at submit and read by every job kind."""

from __future__ import annotations

from pydantic import BaseModel, Field


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
