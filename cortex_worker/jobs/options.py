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
    model: str | None = Field(default=None, max_length=200,
                              description="use this model name instead of the agent manifest's "
                              "(documents: instead of CORTEX_DOCUMENT_MODEL's)")
