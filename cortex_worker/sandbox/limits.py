"""Resource limits of one sandboxed process tree."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Limits(BaseModel):
    """rlimits applied to a sandboxed process (inherited by its children)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu_seconds: int = Field(default=30, gt=0, description="RLIMIT_CPU (SIGXCPU, then SIGKILL +1s)")
    memory_mb: int = Field(default=512, gt=0, description="RLIMIT_AS: address space, not RSS")
    processes: int = Field(default=64, gt=0, description="RLIMIT_NPROC (per user; not for root)")
    file_mb: int = Field(default=64, gt=0, description="RLIMIT_FSIZE: largest file it may write")
